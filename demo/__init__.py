"""A tiny local model and calibration text, so the flow runs with no hub and no GPU."""
