"""Prefect blocks: credentials and settings that never travel as flow parameters."""
