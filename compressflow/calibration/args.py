"""How calibration runs: the pipeline, where the weights live, llm-compressor's speed knobs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from compressflow.arguments import Args, plain_path

# The share of a GPU's free memory the memory plan fills when no cap is set. Its terms leave out
# what also lands on the device: the caching allocator's rounding and fragmentation, and the CUDA
# contexts of the run's other children (on an H100, a run planned at 2.1 GiB peaked at 3186 MB in
# use device-wide: docs/benchmarks/memory-plan.md, "The share of a GPU's free memory"), and free
# memory read at planning time can shrink before calibration starts. A tenth (7.9 GiB of an
# H100's 78.7 GiB free) holds that, and the last tenth is never worth an out-of-memory error
# hours into a run.
GPU_SHARE = 0.9


class CalibrationArgs(Args):
    """How calibration runs: the path, where the weights live, and llm-compressor's speed knobs.

    The defaults need no tuning: a memory plan made from the model's config before any weights
    load picks where the weights live and the batch size, and refuses what cannot fit.
    """

    _paths = field_validator("offload_folder", mode="before")(plain_path("calibration"))

    path: Literal["auto", "classic", "model_free"] = Field(
        default="auto",
        description="auto: a data-free scheme (e.g. FP8_DYNAMIC) whose weights can be quantized "
        "without building the model goes through llm-compressor's model_free_ptq, one shard at a "
        "time; everything else loads the model and runs oneshot (classic). classic forces "
        "oneshot; model_free refuses a recipe that path cannot run.",
    )
    batch_size: int = Field(
        default=0,
        ge=0,
        le=512,
        description="Calibration samples per forward pass; 0 picks the largest of 16, 8, 4, 2 "
        "that fits in memory and cuts at most 2% of the tokens (each batch is cut to its "
        "shortest sample); 1, the only size they take, for AutoRound and image+text data.",
    )
    sequential_prefetch: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Load the next batch onto the GPU while the current one runs (auto: on when "
        "calibrating on a GPU with room for two batches).",
    )
    sequential_offload_device: Literal["cpu", "cuda"] = Field(
        default="cpu",
        description="Where activations between layers wait (cpu: the most room; cuda: faster "
        "when the GPU holds them).",
    )
    moe_calibrate_all_experts: bool = Field(
        default=True,
        description="Send every token through every expert of an MoE layer while calibrating, so "
        "no expert is quantized from too few tokens.",
    )
    max_cpu_memory_gb: float = Field(
        default=0,
        ge=0,
        description="Cap on the CPU memory the run plans to use, in GiB; 0 means what the worker "
        "has available. Weights that do not fit under it are read from disk layer by layer.",
    )
    max_gpu_memory_gb: float = Field(
        default=0,
        ge=0,
        allow_inf_nan=False,
        description="Cap on the peak GPU memory calibration plans for, in GiB, for a GPU shared "
        f"with other work; 0: {GPU_SHARE:.0%} of the GPU's free memory. The automatic batch "
        "shrinks to fit under it; a run that cannot fit even at batch 1 is refused before weights "
        "load. A worker without a GPU ignores it (the plan's notes say so).",
    )
    timeout_minutes: float = Field(
        default=0,
        ge=0,
        description="Stop calibration after this many minutes (0: no limit). It runs in a "
        "process of its own, so stopping it ends it and returns its memory.",
    )
    offload_folder: str = Field(
        default="",
        description="Local folder for weights offloaded to disk; empty: a temporary folder beside "
        "the output, removed after the run.",
    )
    gpus: int = Field(
        default=1,
        ge=1,
        le=64,
        description="GPUs one calibration uses. 1: one process on one free GPU of the host. "
        "More: llm-compressor's distributed oneshot, one process per GPU under torchrun; a host "
        "with fewer GPUs refuses the run before any weights load.",
    )
    checkpoint_interval_s: float = Field(
        default=600,
        allow_inf_nan=False,
        description="Save calibration's progress (finished layers and the activations feeding "
        "the next) at most this often, in seconds, under the cache folder, so a rerun after a "
        "crash resumes from the last finished layer; 0: after every layer; negative: never. "
        "Deleted once the model is published.",
    )
    threads: int = Field(
        default=0,
        ge=0,
        le=1024,
        description="CPU threads calibration runs (torch, OpenMP, tokenizers). 0: the CPUs this "
        "worker may use (its affinity mask and cgroup CPU quota, not the host's core count), "
        "shared with the other compressflow processes computing on this host.",
    )
