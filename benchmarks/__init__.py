"""Benchmarks: scripts that measure the pipeline stages against their targets."""
