"""The compress-model pipeline's stages, one Prefect task per module."""
