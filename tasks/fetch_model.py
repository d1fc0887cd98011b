"""Fetch model: resolves `model_id` to a local folder and records an immutable identity."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class FetchedModel(BaseModel):
    """A model on local disk, and what it is, independent of where it came from."""

    path: str = Field(description="Local folder with config, tokenizer and weights.")
    source: Literal["local", "hub", "clearml"]
    model_id: str
    revision_requested: str | None = None
    revision_resolved: str | None = Field(default=None, description="Hub commit sha.")
    identity: str = Field(
        description="Immutable identity: 'hub:<id>@<sha>', 'clearml:<id>:<hash>' or 'sha256:<hash>'."
    )
    size_bytes: int
    trust_remote_code: bool = False
    model_class: str = "AutoModelForCausalLM"
