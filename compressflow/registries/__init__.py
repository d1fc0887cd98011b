"""Plain-data registries: recipe presets and dataset shortcuts, listable without llm-compressor."""
