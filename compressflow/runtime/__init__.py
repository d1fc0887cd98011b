"""How the flow runs: stage records, the calibration child process, the published event."""
