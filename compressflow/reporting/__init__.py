"""What a person sees of a run: ClearML tracking, Prefect artifacts, progress, lineage, quality figures."""
