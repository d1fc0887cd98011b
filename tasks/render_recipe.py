"""Render recipe: turns any accepted recipe form into one validated llm-compressor recipe."""

from __future__ import annotations

from pydantic import BaseModel, Field


class RenderedRecipe(BaseModel):
    yaml: str = Field(description="The rendered recipe: what oneshot gets and recipe.yaml holds.")
    sha256: str = Field(description="Hash of `yaml`.")
    source: str = Field(description="'preset:W4A16', 'yaml', 'file:<path>', 'dict' or 'list'.")
    modifiers: list[str] = Field(description="Modifier class names, in order.")
    scheme: str | None = Field(default=None, description="Quantization scheme, e.g. W4A16.")
    pipeline: str = Field(description="Effective calibration pipeline for the data modifiers.")
    needs_data: bool = Field(description="Whether any modifier needs calibration data.")
    notes: list[str] = Field(default_factory=list, description="Migrations applied, e.g. legacy observer.")
