"""What publishing returns: the published model and the record of each stage that made it."""

from __future__ import annotations

from pydantic import BaseModel, Field


class StageRecord(BaseModel):
    name: str
    seconds: float
    cached: bool


class PublishedModel(BaseModel):
    """Where the compressed model is and what it is: what downstream flows consume."""

    path: str = Field(
        description="The published folder; the upload URI instead when the run reused an "
        "upload and this worker holds no local copy (a fresh worker: nothing was downloaded)."
    )
    run_key: str
    reused: bool = Field(description="True when an earlier run's output was returned as is.")
    model_identity: str
    scheme: str | None
    size_bytes: int
    original_size_bytes: int
    compression_ratio: float
    stages: list[StageRecord] = Field(
        default_factory=list, description="This run's stages: seconds taken and cache hits."
    )
    upload_uri: str = Field(
        default="",
        description="Where the model was uploaded (output.upload_uri, normalised), complete and "
        "checked; empty when it was not uploaded.",
    )
    tracking: str = Field(default="", description="Where ClearML logged the run, or why it failed.")
