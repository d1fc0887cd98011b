"""Where a run is logged in ClearML."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, field_validator

from compressflow.arguments import BLOCK_NAME_OR_EMPTY, Args, block_name


class TrackingArgs(Args):
    model_config = ConfigDict(hide_input_in_errors=True)  # as ModelArgs: clearml_block

    enabled: bool = Field(default=True, description="Log the run to ClearML.")
    clearml_block: str = Field(
        default="",
        pattern=BLOCK_NAME_OR_EMPTY,
        description="Name of a ClearMLSettings block. Empty (and without CLEARML_* environment "
        "variables): ClearML runs in offline mode.",
    )
    project_name: str = Field(
        default="", description="ClearML project; empty: the block's default project."
    )
    task_name: str = Field(
        default="", description="ClearML task name; empty: the model's name and the scheme."
    )

    @field_validator("clearml_block", mode="before")
    @classmethod
    def _a_name_not_a_key(cls, value: Any) -> Any:
        return block_name(value, "tracking.clearml_block")  # as ModelArgs.hub_token_block
