"""What the data slice's stages return: the tokenized calibration set and held-out text."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field


class BuiltDataset(BaseModel):
    path: str = Field(description="datasets.save_to_disk folder with input_ids and attention_mask.")
    fingerprint: str = Field(
        description="sha256 over the tokenized samples and how they were made."
    )
    source: str = Field(description="Where the rows came from, e.g. 'shortcut:python_docs'.")
    num_samples: int
    token_stats: dict[str, float] = Field(description="min, mean, max and total tokens per sample.")
    chat_template_applied: bool = False

    def exists(self) -> bool:
        return Path(self.path, "dataset_info.json").exists()


class HeldOutText(BaseModel):
    source: str
    input_ids: list[list[int]] = Field(description="One tokenized sample per entry, unpadded.")
    excluded_calibration_samples: int = Field(
        description="Rows left out because the compressed model was calibrated on them."
    )
