"""What calibrating returns: the staged output and what each module and layer took."""

from __future__ import annotations

from pydantic import BaseModel, Field


class ModuleMetric(BaseModel):
    name: str
    error: float | None = None
    seconds: float | None = None


class LayerTime(BaseModel):
    """One subgraph (decoder layer) of the sequential pipeline: what every algorithm reports."""

    calibration_pass: int = Field(description="1-based; W8A8 makes one pass per data modifier.")
    layer: int = Field(description="0-based subgraph index; 0 holds the embeddings.")
    seconds: float = Field(description="Calibration and compression of this subgraph.")


class Calibration(BaseModel):
    staging_path: str = Field(description="Folder holding the saved checkpoint, not yet published.")
    seconds: float
    peak_rss_mb: float = Field(description="Peak resident memory of the process so far.")
    peak_gpu_mb: float | None = Field(default=None, description="Peak CUDA memory, when on GPU.")
    checkpoint_bytes: int
    modules: list[ModuleMetric] = Field(
        default_factory=list, description="GPTQ's per-module loss and time (GPTQ only)."
    )
    layers: list[LayerTime] = Field(
        default_factory=list, description="Seconds per subgraph, for every algorithm."
    )
    reference_seconds: float | None = Field(
        default=None,
        description="Time spent capturing the base model's reference logits; None on the "
        "model-free path, whose verify pass takes them.",
    )
    reference_path: str | None = Field(
        default=None,
        description="The base model's logits on the verification texts, captured before "
        "calibration changed the model (a file beside the staging folder, never published); "
        "None on the model-free path, which leaves the source as it is.",
    )
    resumed_from: str | None = Field(
        default=None,
        description="Where this calibration resumed from a crashed run's checkpoint ('pass 1, "
        "layer 3 of 9'); None: it ran from the start.",
    )
