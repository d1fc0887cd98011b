"""The data slice's parameters: where calibration and held-out text come from, and how much."""

from __future__ import annotations

from pydantic import Field, field_validator

from compressflow.arguments import IMPORT_PATH_OR_EMPTY, Args, plain_path


class TextSourceArgs(Args):
    """Where text comes from: shared by calibration data and held-out evaluation text."""

    _paths = field_validator("dataset_name", mode="before")(plain_path("dataset"))

    dataset_name: str = Field(
        default="python_docs",
        min_length=1,
        description="A registered shortcut (see compressflow.registries.datasets), a hub dataset "
        "id, or a local .txt/.jsonl/.json/.parquet/.csv/.arrow file or a folder of them (up to "
        "COMPRESSFLOW_MAX_DATA_MB, 1 GiB by default).",
    )
    dataset_config_name: str = Field(
        default="", description="Hub dataset configuration (subset) name; empty: the default one."
    )
    split: str = Field(
        default="", description="Split to sample from; empty: a shortcut's default, else train."
    )
    text_column: str = Field(
        default="",
        description="Column holding the text or the chat messages; a shortcut's default, else "
        "'text' or 'messages' when present.",
    )
    dataset_loader: str = Field(
        default="",
        pattern=IMPORT_PATH_OR_EMPTY,
        description="`module:function` returning a datasets.Dataset, called with the DatasetArgs; "
        "replaces the built-in loading. Empty: the built-in loading.",
    )


class DatasetArgs(TextSourceArgs):
    text_samples: int = Field(
        default=256, ge=0, description="Number of calibration samples (0 for data-free recipes)."
    )
    vision_samples: int = Field(
        default=0, ge=0, description="Number of image samples; needs a model with a processor."
    )
    max_seq_len: int = Field(default=2048, gt=0, description="Maximum tokens per sample.")
    seed: int = Field(default=42, description="Seed for sampling rows: same seed, same samples.")
    data_collator: str = Field(
        default="",
        pattern=IMPORT_PATH_OR_EMPTY,
        description="`module:function` used as oneshot's data_collator; empty: the default.",
    )


class HeldOutArgs(TextSourceArgs):
    """Evaluation text. When it is the calibration dataset, the calibration samples are left out."""

    samples: int = Field(default=32, gt=0, description="Number of held-out texts scored.")
    max_seq_len: int = Field(default=512, gt=1, description="Maximum tokens per text.")
    seed: int = Field(
        default=1234, description="Seed for sampling held-out rows (calibration's default is 42)."
    )

    def dataset_args(self) -> DatasetArgs:
        fields = self.model_dump(exclude={"samples"})
        return DatasetArgs(**fields, text_samples=self.samples)
