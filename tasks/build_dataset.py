"""Build dataset: loads, samples, templates and tokenizes the calibration data."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field


class BuiltDataset(BaseModel):
    path: str = Field(description="datasets.save_to_disk folder with input_ids and attention_mask.")
    fingerprint: str = Field(description="sha256 over the tokenized samples and how they were made.")
    source: str = Field(description="Where the rows came from, e.g. 'shortcut:python_docs'.")
    num_samples: int
    token_stats: dict[str, float] = Field(description="min, mean, max and total tokens per sample.")
    chat_template_applied: bool = False

    def exists(self) -> bool:
        return Path(self.path, "dataset_info.json").exists()
