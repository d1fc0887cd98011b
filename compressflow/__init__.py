"""compressflow: Prefect flows that compress LLMs with llm-compressor, tracked in ClearML.

This folder is the bottom layer, importing nothing above it. Its root holds the shared
vocabulary (params, results, errors, settings, logs), the plain-data registries and `compat`, the
one adapter to library internals; its groups are `recipes/`, `data/`, `model/`, `store/` (which
do not import one another), `reporting/` and `runtime/`. The stages (`compressflow.tasks`, the
tasks/ folder) and the entrypoints (`compressflow.flows`, the flows/ folder) sit on top; see the
Layout section of README.md.
"""
