"""Calibration: its parameters and its result (calibrating itself runs in runtime/calibration.py, in its child)."""
