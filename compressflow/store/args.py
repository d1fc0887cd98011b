"""Where a run publishes, and with which tags."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import Field, field_validator

from compressflow.arguments import TAG, Args, plain_path
from compressflow.errors import InputError


class OutputArgs(Args):
    _paths = field_validator("save_directory", mode="before")(plain_path("output"))

    save_directory: str = Field(
        default="",
        description="Where the compressed model is published. Empty: a folder named "
        "MODEL-SCHEME under $COMPRESSFLOW_OUTPUT_DIR (or ./outputs).",
    )
    # Tags go to the Prefect server, ClearML and the manifest of every run: bounded, one line each.
    tags: list[Annotated[str, Field(min_length=1, max_length=100, pattern=TAG)]] = Field(
        default_factory=list,
        max_length=50,
        description="Tags for the Prefect run, ClearML and the manifest (the scheme is added): "
        "at most 50, each one line of at most 100 characters.",
    )
    save_compressed: bool = Field(
        default=True, description="Save in compressed-tensors format (what vLLM serves)."
    )
    overwrite: bool = Field(
        default=False,
        description="Replace an earlier compressflow output at save_directory: only the files its "
        "manifest lists are deleted, and a folder holding anything else is refused.",
    )
    auto_evaluate: bool = Field(
        default=True,
        description="Let the evaluate-model deployment's trigger evaluate this output (its "
        "published event says so); sweeps turn it off and evaluate their points themselves.",
    )

    @field_validator("tags", mode="before")
    @classmethod
    def _one_line_each(cls, tags: Any) -> Any:
        # Before the pattern, whose own message shows a regex instead of the problem.
        for number, tag in enumerate(tags if isinstance(tags, list) else []):
            if isinstance(tag, str) and re.search(r"[\x00-\x1f\x7f]", tag):
                raise InputError(
                    "output.tags",
                    f"tag {number + 1}, {tag[:40]!r}, holds a newline or another control character",
                    "write each tag as one line of plain text",
                )
        return tags
