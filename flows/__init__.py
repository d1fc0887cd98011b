"""Prefect flows: compress-model and the flows built around it."""
