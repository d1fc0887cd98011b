"""compressflow: Prefect flows that compress LLMs with llm-compressor, tracked in ClearML.

This folder is the bottom layer: parameters, results, the manifest, errors, settings,
registries and infrastructure (tracking, caching, locks, disk space, progress, events, logs).
It imports nothing above it. The stages (`compressflow.tasks`, the tasks/ folder) and the
entrypoints (`compressflow.flows`, the flows/ folder) sit on top; see README.md.
"""
