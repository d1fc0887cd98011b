"""Calibrate: runs llm-compressor's `oneshot` and writes the checkpoint to a staging folder.

The checkpoint goes to a staging folder next to the final output (same filesystem), which the
publish stage seals with a rename: the model is saved once and never reloaded. Per-module
metrics exist in llm-compressor only as log lines (an INFO "Quantizing 1 module(s): [name]"
followed by METRIC "time 0.06s" and "error 9.05"), so a loguru sink collects them while it runs.
"""

from __future__ import annotations

import re
import resource
import time
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from pydantic import BaseModel, Field

from flows.params import RecipeArgs
from tasks import tracking
from tasks.build_dataset import BuiltDataset
from tasks.check_traceability import restored_torch_functions
from tasks.disk_space import disk_full_is_clear
from tasks.fetch_model import FetchedModel, folder_size
from tasks.imports import import_callable
from tasks.progress import sequential_passes, subgraphs_per_pass, watch_calibration
from tasks.render_recipe import RenderedRecipe


class ModuleMetric(BaseModel):
    name: str
    error: float | None = None
    seconds: float | None = None


class Calibration(BaseModel):
    staging_path: str = Field(description="Folder holding the saved checkpoint, not yet published.")
    seconds: float
    peak_rss_mb: float = Field(description="Peak resident memory of the process so far.")
    peak_gpu_mb: float | None = Field(default=None, description="Peak CUDA memory, when on GPU.")
    checkpoint_bytes: int
    modules: list[ModuleMetric] = Field(default_factory=list)


_QUANTIZING = re.compile(r"Quantizing \d+ module\(s\): \[(.*)\]")
_METRIC = re.compile(r"^(time|error)\s+([-+0-9.eE]+|nan|inf)s?$")


class ModuleMetricSink:
    """A loguru sink that turns llm-compressor's per-module log lines into ModuleMetric rows."""

    def __init__(self):
        self.modules: list[ModuleMetric] = []

    def __call__(self, message) -> None:
        record = message.record
        text = record["message"].strip()
        if match := _QUANTIZING.search(text):
            names = [name.strip(" '\"") for name in match.group(1).split(",")]
            self.modules.extend(ModuleMetric(name=name) for name in names)
        elif record["level"].name == "METRIC" and self.modules:
            if match := _METRIC.match(text):
                kind, value = match.groups()
                setattr(self.modules[-1], "seconds" if kind == "time" else "error", float(value))


def layer_index(module_name: str) -> int:
    """`model.layers.3.mlp.up_proj` -> 3, so errors plot against depth; 0 when there is none."""
    match = re.search(r"\.(\d+)\.", module_name)
    return int(match.group(1)) if match else 0


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


@task(name="calibrate", cache_policy=NO_CACHE)
def calibrate(
    model: FetchedModel,
    dataset: BuiltDataset | None,
    recipe: RenderedRecipe,
    args: RecipeArgs,
    staging_path: str,
    save_compressed: bool = True,
    data_collator: str | None = None,
) -> Calibration:
    """Load the model, run oneshot with the rendered recipe, save the result to `staging_path`."""
    import torch
    import transformers
    from datasets import load_from_disk
    from llmcompressor import oneshot
    from loguru import logger as loguru_logger

    log = get_run_logger()
    model_cls = getattr(transformers, model.model_class)
    loaded = model_cls.from_pretrained(
        model.path, dtype="auto", trust_remote_code=model.trust_remote_code
    )
    processor = transformers.AutoProcessor.from_pretrained(
        model.path, trust_remote_code=model.trust_remote_code
    )
    kwargs = {}
    if dataset is not None:
        calibration_data = load_from_disk(dataset.path)
        kwargs.update(
            dataset=calibration_data,
            num_calibration_samples=len(calibration_data),
            shuffle_calibration_samples=False,  # sampled (seeded) by the dataset stage
        )
    if data_collator:
        kwargs["data_collator"] = import_callable(data_collator, "dataset.data_collator", call_with=([],))
    if args.pipeline:
        kwargs["pipeline"] = args.pipeline
    if args.sequential_targets:
        kwargs["sequential_targets"] = args.sequential_targets
    if args.tracing_ignore:
        kwargs["tracing_ignore"] = args.tracing_ignore

    sink = ModuleMetricSink()
    sink_id = loguru_logger.add(sink, level="DEBUG", format="{message}")
    started = time.perf_counter()
    passes = sequential_passes(recipe.yaml, args.pipeline) if dataset is not None else 0
    try:
        with (
            restored_torch_functions(),  # the sequential pipeline traces too
            watch_calibration(subgraphs_per_pass(loaded, args.sequential_targets), passes),
        ):
            oneshot(model=loaded, processor=processor, recipe=recipe.yaml, **kwargs)
    finally:
        loguru_logger.remove(sink_id)
    seconds = time.perf_counter() - started

    staging = Path(staging_path)
    with disk_full_is_clear(staging):
        loaded.save_pretrained(staging, save_compressed=save_compressed)
        processor.save_pretrained(staging)
    result = Calibration(
        staging_path=str(staging),
        seconds=seconds,
        peak_rss_mb=peak_rss_mb(),
        peak_gpu_mb=torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
        checkpoint_bytes=folder_size(staging),
        modules=sink.modules,
    )
    log.info(
        "Calibrated %d module(s) in %.1f s; peak RSS %.0f MB",
        len(result.modules),
        seconds,
        result.peak_rss_mb,
    )
    tracker = tracking.current()
    for module in result.modules:
        series = module.name.rsplit(".", 1)[-1]
        if module.error is not None:
            tracker.scalar("quantization error by layer", series, module.error, layer_index(module.name))
        if module.seconds is not None:
            tracker.scalar("calibration seconds by layer", series, module.seconds, layer_index(module.name))
    tracker.single("calibration seconds", seconds)
    tracker.single("peak RSS MB", result.peak_rss_mb)
    if result.peak_gpu_mb is not None:
        tracker.single("peak GPU MB", result.peak_gpu_mb)
    return result
