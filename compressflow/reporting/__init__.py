"""What a person sees of a run: ClearML tracking, Prefect artifacts, progress, lineage, the card
and charts (the quality figures themselves are `compressflow.evaluation`'s)."""
