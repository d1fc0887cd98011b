"""What the model slice's stages return: the fetched source, its trace report, the memory plan."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field


class FetchedModel(BaseModel):
    """A model on local disk, and what it is, independent of where it came from."""

    path: str = Field(description="Local folder with config, tokenizer and weights.")
    source: Literal["local", "hub", "clearml", "store"] = Field(
        description="Where it came from; store: an s3:// or file:// prefix, downloaded into the "
        "worker's cache (model_id is the URI)."
    )
    model_id: str
    revision_requested: str | None = None
    revision_resolved: str | None = Field(default=None, description="Hub commit sha.")
    identity: str = Field(
        description="Immutable identity: 'hub:<id>@<sha>', 'clearml:<id>:<hash>' or 'sha256:<hash>' (a "
        "local folder's or a store download's content hash)."
    )
    size_bytes: int
    parameters: int | None = Field(default=None, description="From safetensors headers.")
    trust_remote_code: bool = False
    model_class: str = "AutoModelForCausalLM"
    files: dict[str, str] = Field(
        default_factory=dict,
        exclude=True,  # a run's own record, not the model's: kept out of manifests and logs
        description="Each file of the folder -> its size, times and inode, taken before it was "
        "hashed or read: publish refuses when one changed since (the source was written while "
        "the run read it; store.identity.changed_since).",
    )

    def exists(self) -> bool:
        return Path(self.path, "config.json").exists()


class TraceReport(BaseModel):
    checked: bool
    subgraphs: int | None = None
    seconds: float = 0.0
    reason: str = ""
    sequential_targets: list[str] = Field(
        default_factory=list, description="Module class names the model was partitioned at."
    )
    tracing_ignore: list[str] = Field(
        default_factory=list, description="Function names the tracer skipped."
    )
    peak_rss_mb: float | None = Field(
        default=None,
        description="Process peak resident memory after tracing (getrusage ru_maxrss). It "
        "includes the imports and anything the process did before; it is per config only in a "
        "fresh process, which is how the benchmark measures it.",
    )
    rss_growth_mb: float | None = Field(
        default=None,
        description="How much tracing raised that peak: 0 when an earlier step peaked higher.",
    )


def gib(size: float) -> str:
    """Bytes in GiB, or MiB below one GiB (so small figures do not read 0.00)."""
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def gpu_limit(budget: int, free: int, share: float, capped: bool) -> str:
    """The GPU memory the plan may fill, in words: the user's cap, or its share of the free."""
    of_free = f"{share:.0%} of the {gib(free)} free"
    if capped:
        return f"the {gib(budget)} cap (calibration.max_gpu_memory_gb, below {of_free})"
    return of_free


class MemoryPlan(BaseModel):
    """Where calibration keeps the weights and what it expects to need, from the config alone."""

    path: Literal["classic", "model_free"] = Field(
        description="classic: load the model and run oneshot; model_free: quantize shard by shard."
    )
    placement: Literal["gpu", "cpu", "disk", "shards"] = Field(
        description="Where the weights live while calibrating: on the GPU, in CPU memory, read "
        "from disk layer by layer, or one shard at a time (model_free)."
    )
    device: str = Field(description="Where each layer is computed: cuda or cpu.")
    weight_bytes: int = Field(description="The model's weights as loaded.")
    largest_layer_bytes: int = Field(description="The largest sequential layer's weights.")
    state_bytes: int = Field(
        description="The largest layer's calibration state (GPTQ Hessians: in_features^2 float32 "
        "per module, every expert of an MoE layer at once)."
    )
    activation_bytes: int = Field(
        description="Activations cached between layers: samples x tokens x hidden, in and out."
    )
    batch_bytes: int = Field(description="Working memory of one forward pass of one batch.")
    largest_shard_bytes: int = Field(default=0, description="The largest safetensors shard.")
    cpu_needed_bytes: int = Field(description="Planned peak CPU memory.")
    cpu_available_bytes: int = Field(description="CPU memory the plan may use (cap or available).")
    gpu_needed_bytes: int = Field(default=0, description="Planned peak GPU memory.")
    gpu_available_bytes: int = Field(default=0, description="Free GPU memory; 0 without a GPU.")
    gpu_budget_bytes: int = Field(
        default=0,
        description="GPU memory the plan may fill: its share of the free memory (gpu_share), or "
        "calibration.max_gpu_memory_gb where that is less; 0 without a GPU.",
    )
    gpu_share: float = Field(default=0, description="The share of free GPU memory the plan fills.")
    gpu_capped: bool = Field(
        default=False,
        description="Whether calibration.max_gpu_memory_gb, not the share, set the GPU budget.",
    )
    gpu_batch_one_bytes: int = Field(
        default=0,
        description="Planned peak GPU memory at batch 1: what the chosen batch costs over it.",
    )
    batch_size: int
    sequential_prefetch: bool
    sequential_offload_device: str
    moe_calibrate_all_experts: bool
    offload_folder: str | None = Field(
        default=None, description="Folder for weights offloaded to disk (placement disk)."
    )
    model_free_scheme: str | None = Field(
        default=None, description="The scheme model_free_ptq applies (path model_free)."
    )
    model_free_ignore: list[str] = Field(
        default_factory=list,
        description="Modules model_free_ptq leaves alone: the recipe's ignore list and every 2-D "
        "weight that is not a Linear's (embeddings), which it cannot tell apart by name.",
    )
    weights_in_memory_bytes: int = Field(
        description="How much of the weights may stay in CPU memory; the rest is read from disk "
        "module by module when used (placement disk and shards)."
    )
    checkpoint_folder: str = Field(
        default="",
        description="Where calibration checkpoints go (one subfolder per recipe); empty: none.",
    )
    checkpoint_interval_s: float = Field(
        default=-1, description="Seconds between calibration checkpoints; negative: none."
    )
    checkpoint_bytes: int = Field(
        default=0,
        description="Disk the calibration checkpoint may take: the weights once per sequential "
        "pass, plus the activations between layers.",
    )
    threads: int = Field(
        default=0,
        description="CPU threads calibration starts with (0: not planned); an automatic count "
        "follows the computing processes on the host while it runs (a note says why).",
    )
    notes: list[str] = Field(default_factory=list, description="Why the plan chose what it did.")

    def summary(self) -> str:
        human = gib
        if self.path == "model_free":
            return (
                f"model_free path: {self.model_free_scheme} shard by shard on {self.device}, no "
                f"model built: largest shard {human(self.largest_shard_bytes)}; CPU "
                f"{human(self.cpu_needed_bytes)} of {human(self.cpu_available_bytes)}"
            )
        gpu = (
            f", GPU {human(self.gpu_needed_bytes)} of {human(self.gpu_budget_bytes)}"
            if self.gpu_available_bytes
            else ""
        )
        return (
            f"{self.path} path, weights on {self.placement}, computed on {self.device}: "
            f"weights {human(self.weight_bytes)}, largest layer {human(self.largest_layer_bytes)}, "
            f"calibration state {human(self.state_bytes)}, cached activations "
            f"{human(self.activation_bytes)}; CPU {human(self.cpu_needed_bytes)} of "
            f"{human(self.cpu_available_bytes)}{gpu}; batch {self.batch_size}"
            + (
                f"; checkpoints every {self.checkpoint_interval_s:g} s, up to "
                f"{human(self.checkpoint_bytes)} of disk"
                if self.checkpoint_folder
                else "; no checkpoints"
            )
        )

    def gpu_cost(self) -> str:
        """The planned GPU peak against batch 1's and what kept it there; empty without a GPU."""
        if self.device != "cuda":
            return ""
        what = "shard by shard" if self.path == "model_free" else f"batch {self.batch_size}"
        extra = self.gpu_needed_bytes - self.gpu_batch_one_bytes
        more = self.path == "classic" and self.batch_size > 1
        limit = gpu_limit(
            self.gpu_budget_bytes, self.gpu_available_bytes, self.gpu_share, self.gpu_capped
        )
        return (
            f"{what}: {gib(self.gpu_needed_bytes)} planned GPU peak"
            + (f", +{gib(extra)} over batch 1" if more else "")
            + f", within {limit}"
        )
