"""Calibration data: text sources and their readers, local text, image+text rows, user loaders."""
