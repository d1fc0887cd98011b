"""Calibration, in the process that holds the model: llm-compressor's `oneshot` (or its
model-free path) run as the memory plan says, the checkpoint written to a staging folder.

The checkpoint goes to a staging folder next to the final output (same filesystem), which the
publish stage seals with a rename: the model is saved once and never reloaded. Per-module
metrics exist in llm-compressor only as log lines (an INFO "Quantizing 1 module(s): [name]"
followed by METRIC "time 0.06s" and "error 9.05"), so a loguru sink collects them while it runs.

`calibrate_here` is the process's entry point: the calibrate task (tasks/calibrate.py) starts it
in a process of its own (compressflow.runtime.isolation), or one per GPU under torchrun
(compressflow.runtime.distributed): ending the task ends it, and its memory, GPU memory
included, goes back when it exits.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import time
from collections.abc import Callable
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from compressflow import compat
from compressflow.calibration.pipeline import resumable_pipeline
from compressflow.calibration.ranks import rank_share, this_rank
from compressflow.calibration.resume import CalibrationCheckpoint, expire
from compressflow.compat import (
    add_reloadable_ignore_names,
    as_plain_linear,
    save_under_source_names,
)
from compressflow.data.build import first_sample
from compressflow.data.tokenizer import load_processor
from compressflow.data.user_code import import_callable
from compressflow.data.vision import collate_one
from compressflow.errors import CalibrationError, first_line
from compressflow.evaluation.quality import logits_of, save_reference
from compressflow.evaluation.reference import (
    first_non_finite,
    non_finite_source,
    reference_samples,
    refuse_non_finite,
)
from compressflow.inputs import Inputs
from compressflow.logs import run_logger
from compressflow.model import compile_cache
from compressflow.model.loading import load_complete
from compressflow.model.offload import load_offloaded
from compressflow.model.tracing import trace_config
from compressflow.params import RecipeArgs, VerifyArgs
from compressflow.registries.architectures import ARCHITECTURES, PLAIN_LINEAR_EVERYWHERE
from compressflow.reporting.progress import on_subgraph_done, sequential_passes, subgraphs_per_pass
from compressflow.results import (
    BuiltDataset,
    Calibration,
    FetchedModel,
    MemoryPlan,
    ModuleMetric,
    RenderedRecipe,
    TraceReport,
    gib,
)
from compressflow.settings import settings
from compressflow.store.disk_space import disk_full_is_clear, folder_size
from compressflow.store.identity import calibration_resume_key
from compressflow.store.output import source_folder
from compressflow.store.staging import compile_cache_path, reference_path

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


def raised_in(exc: BaseException, function) -> bool:
    """Whether `function`'s own code is on the traceback of `exc` (False for no function)."""
    code = getattr(function, "__code__", None)
    frame = exc.__traceback__
    while code is not None and frame is not None:
        if frame.tb_frame.f_code is code:
            return True
        frame = frame.tb_next
    return False


def capture_reference(
    logits_for, processor, verify: VerifyArgs, staging: Path, source: FetchedModel
) -> Path:
    """Save the base model's logits on the verification texts (`logits_for(token ids)`), with
    the token ids.

    The first forward pass over the source: non-finite logits are refused here, naming the
    tensor (found in the checkpoint), rather than blamed on the compression by verify.
    """
    samples = reference_samples(processor, verify)
    logits = logits_for(samples)
    refuse_non_finite(logits, source)
    path = reference_path(staging)
    with disk_full_is_clear(staging):
        save_reference(path, samples, logits)
    return path


# Files a server reads beside the weights; saved by whatever processor could be built, and
# copied from the source when it could not build them (e.g. an image processor config).
PREPROCESSING = (
    "*processor_config.json",
    "chat_template.*",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "*.tiktoken",
    "generation_config.json",
)


def copy_preprocessing_files(source: Path, staging: Path) -> None:
    """Copy the tokenizer's and generation's files the processor's save did not write.

    Only files that are the source's own: a link out of its folder (a hub snapshot's links stay
    inside its repository's cache folder) could publish any file the worker can read, such as a
    credentials file, under a tokenizer's name."""
    home = source_folder(source)
    for pattern in PREPROCESSING:
        for file in source.glob(pattern):
            if not file.is_file() or (staging / file.name).exists():
                continue
            if home not in file.resolve().parents:
                run_logger(__name__).warning(
                    "Not copied: %s links to %s, outside the model's folder", file, file.resolve()
                )
                continue
            shutil.copy2(file, staging / file.name)


def load_for_calibration(model: FetchedModel, plan: MemoryPlan):
    """The base model where the plan keeps its weights: CPU memory, or read from disk by layer.

    For disk, compressed-tensors' offloading loads what fits under the plan's weight budget into
    CPU memory and leaves the rest in the checkpoint's safetensors files, which each layer is
    read from when the sequential pipeline reaches it.
    """
    import transformers

    if plan.placement not in ("disk", "shards"):
        loaded = load_complete(
            getattr(transformers, model.model_class),
            model.path,
            "the source model",
            dtype="auto",
            trust_remote_code=model.trust_remote_code,
        )
        # Every weight is in memory: a broken source is refused before calibration, whichever
        # tensor it is (the reference logits miss unused embedding rows and unrouted experts).
        if name := first_non_finite(loaded.named_parameters()):
            raise non_finite_source(model, name)
        return loaded
    run_logger(__name__).info(
        "Loading %s with %s of its weights in memory, the rest read from disk when used",
        model.model_id,
        gib(plan.weights_in_memory_bytes),
    )
    return load_offloaded(model, plan)


def calibrate_model_free(model: FetchedModel, plan: MemoryPlan, staging_path: str) -> Calibration:
    """Quantize the checkpoint shard by shard with llm-compressor's model_free_ptq.

    No reference logits are captured here: the source is left as it is, so verify takes them in
    the same forward as the compressed model's, reading the source once for both.
    """
    from llmcompressor import model_free_ptq

    log = run_logger(__name__)
    staging = Path(staging_path)
    started = time.perf_counter()
    log.info(
        "Quantizing %s to %s shard by shard (no model built)",
        model.model_id,
        plan.model_free_scheme,
    )
    with disk_full_is_clear(staging), compat.linears_built_without_init():
        try:
            model_free_ptq(
                model.path,
                staging,
                scheme=plan.model_free_scheme,
                ignore=plan.model_free_ignore,
                device=plan.device,
            )
        except (RuntimeError, ValueError, TypeError, AssertionError, KeyError) as exc:
            raise CalibrationError(
                "calibration.path",
                f"llm-compressor's model_free_ptq failed on {model.model_id}: {first_line(exc)}",
                "set calibration.path to classic (oneshot builds the model and knows its "
                "classes), and report the architecture",
            ) from exc
        copy_preprocessing_files(Path(model.path), staging)
    seconds = time.perf_counter() - started
    return Calibration(
        staging_path=str(staging),
        seconds=seconds,
        peak_rss_mb=peak_rss_mb(),
        checkpoint_bytes=folder_size(staging),
    )


def calibration_checkpoint(
    model: FetchedModel,
    dataset: BuiltDataset | None,
    recipe: RenderedRecipe,
    plan: MemoryPlan,
    oneshot_kwargs: dict,
) -> CalibrationCheckpoint | None:
    """The checkpoint of this calibration when the plan has them; it finds one a crashed run
    left (and resumes from it) or starts one. Checkpoints no run came back for expire first."""
    days = settings().checkpoint_retention_days
    for stale in expire(days * 86400):
        run_logger(__name__).info(
            "Removed calibration checkpoint %s: nothing saved into it within "
            "COMPRESSFLOW_CHECKPOINT_RETENTION_DAYS (%g)",
            stale,
            days,
        )
    if not plan.checkpoint_folder or dataset is None:
        return None
    key = calibration_resume_key(model, dataset, recipe, oneshot_kwargs, plan.device)
    folder = Path(plan.checkpoint_folder) / recipe.sha256[:16]
    return CalibrationCheckpoint(folder, key, plan.checkpoint_interval_s)


@contextmanager
def resumable(checkpoint: CalibrationCheckpoint | None, pipeline: str, oneshot_kwargs: dict):
    """Route oneshot's sequential passes through the checkpointing pipeline
    (compressflow.calibration.pipeline says why a copy of the library's); `basic` and `datafree`
    have no layers to resume from."""
    if checkpoint is None or pipeline not in ("auto", "independent", "sequential"):
        yield
        return
    with resumable_pipeline(checkpoint, independent=pipeline != "sequential") as name:
        oneshot_kwargs["pipeline"] = name
        yield


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def calibrate_here(
    inputs: Inputs, plan: MemoryPlan, staging_path: str, events: Callable[..., None]
) -> Calibration:
    """Load the model as `plan` says, run oneshot with `inputs.recipe`, save it to `staging_path`.

    Before oneshot changes the model, its logits on the verification texts are saved beside
    the staging folder, so the verify stage compares against the base without loading it again.
    A model-free plan quantizes the checkpoint shard by shard instead (`calibrate_model_free`).
    `events("progress", (per_pass, passes))` and `events("subgraph")` report progress.
    """
    # The run compiles into a cache of its own (compile_cache says why); importing
    # llm-compressor already set the shared default here, so it is replaced, not defaulted.
    # This process is the run's alone.
    compiled = compile_cache_path(Path(staging_path))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compiled)
    model, dataset, recipe, args = inputs.model, inputs.dataset, inputs.recipe, inputs.args.recipe
    verify, data_collator = inputs.args.verify, inputs.args.dataset.data_collator
    save_compressed = inputs.args.output.save_compressed
    if plan.path == "model_free":
        return calibrate_model_free(model, plan, staging_path)
    compile_cache.seed(compiled)  # oneshot may compile (AutoRound does); model_free_ptq does not
    import torch
    from datasets import load_from_disk
    from llmcompressor import oneshot
    from loguru import logger as loguru_logger

    log = run_logger(__name__)
    loaded = load_for_calibration(model, plan)
    processor = load_processor(model)
    started = time.perf_counter()
    reference = capture_reference(
        partial(logits_of, loaded), processor, verify, Path(staging_path), model
    )
    reference_seconds = time.perf_counter() - started
    rule = ARCHITECTURES.get(recipe.architecture)
    classes = PLAIN_LINEAR_EVERYWHERE + (rule.linear_classes if rule else ())
    if count := as_plain_linear(loaded, classes):
        log.info("Calibrating %d %s module(s) as nn.Linear", count, "/".join(classes))
    kwargs = {}
    if dataset is not None:
        calibration_data = load_from_disk(dataset.path)
        rank, world = this_rank()
        if world > 1:
            share = rank_share(len(calibration_data), rank, world)
            calibration_data = calibration_data.select(share)
            log.info(
                "Rank %d of %d calibrates on samples %d to %d", rank, world, share[0], share[-1]
            )
        kwargs.update(
            dataset=calibration_data,
            num_calibration_samples=len(calibration_data),
            shuffle_calibration_samples=False,  # sampled (seeded) by the dataset stage
        )
    if dataset is not None and "pixel_values" in calibration_data.column_names:
        kwargs["data_collator"] = collate_one  # a user's collator, below, wins
    user_collator = None
    if data_collator:
        user_collator = import_callable(data_collator, "dataset.data_collator", call_with=([],))
        kwargs["data_collator"] = user_collator
    if dataset is not None:
        kwargs.update(
            batch_size=plan.batch_size,
            sequential_prefetch=plan.sequential_prefetch,
            sequential_offload_device=plan.sequential_offload_device,
            moe_calibrate_all_experts=plan.moe_calibrate_all_experts,
        )
    if args.pipeline != "auto":
        kwargs["pipeline"] = args.pipeline
    if targets := args.sequential_targets or recipe.sequential_targets:
        kwargs["sequential_targets"] = targets
    if args.tracing_ignore:
        kwargs["tracing_ignore"] = args.tracing_ignore

    sink = ModuleMetricSink()
    sink_id = loguru_logger.add(sink, level="DEBUG", format="{message}")
    started = time.perf_counter()
    passes = sequential_passes(recipe.data_modifiers, args.pipeline) if dataset is not None else 0
    checkpoint = calibration_checkpoint(model, dataset, recipe, plan, kwargs)
    try:
        with (
            compat.restored_torch_functions(),  # the sequential pipeline traces too
            on_subgraph_done(lambda: events("subgraph")),
            resumable(checkpoint, args.pipeline, kwargs),
        ):
            events("progress", (subgraphs_per_pass(loaded, targets), passes))
            oneshot(model=loaded, processor=processor, recipe=recipe.yaml, **kwargs)
    except (RuntimeError, ValueError, TypeError, AssertionError, KeyError) as exc:
        # What the checks before calibration could not foresee: said in the one error format,
        # with llm-compressor's own error chained below it.
        cause = first_line(exc)
        if raised_in(exc, user_collator):
            raise CalibrationError(
                "dataset.data_collator",
                f"the collator {data_collator} raised while calibrating: {cause}",
                "fix the collator (it receives a list of the dataset's tokenized rows) or leave "
                "dataset.data_collator empty; the full traceback is in this run's log",
            ) from exc
        raise CalibrationError(
            recipe.given_in(),
            f"llm-compressor failed while calibrating {model.model_id}: {cause}",
            "if the message names a layer, add it to the recipe's ignore list (a preset's: "
            "recipe_args `ignore`); run "
            "`compressflow validate` on these parameters; the full traceback is in this run's log",
        ) from exc
    finally:
        loguru_logger.remove(sink_id)
    seconds = time.perf_counter() - started

    if rule and rule.expert_renames:
        save_under_source_names(loaded, rule.expert_renames)
    staging = Path(staging_path)
    with disk_full_is_clear(staging):
        loaded.save_pretrained(staging, save_compressed=save_compressed)
        processor.save_pretrained(staging)
        copy_preprocessing_files(Path(model.path), staging)
    for name in add_reloadable_ignore_names(staging, loaded):
        log.info("ignore list: added %s, the name the reloaded model gives that module", name)
    result = Calibration(
        staging_path=str(staging),
        seconds=seconds,
        peak_rss_mb=peak_rss_mb(),
        peak_gpu_mb=torch.cuda.max_memory_allocated() / 2**20
        if torch.cuda.is_available()
        else None,
        checkpoint_bytes=folder_size(staging),
        modules=sink.modules,
        reference_seconds=round(reference_seconds, 3),
        reference_path=str(reference),
        resumed_from=checkpoint.resumed_from if checkpoint else None,
    )
    compile_cache.keep(compiled)
    return result


# Here, not in a bottom group: it joins the data group's sample and the model group's trace.
# Beside calibrate_here: the trace is the one its sequential pipeline will make.
def trace_for_pipeline(
    model: FetchedModel, recipe: RenderedRecipe, dataset: BuiltDataset, args: RecipeArgs
) -> TraceReport:
    """The model's config traced on the meta device as the sequential pipeline will."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    return trace_config(
        config,
        first_sample(dataset),
        model_class=model.model_class,
        sequential_targets=args.sequential_targets or recipe.sequential_targets,
        tracing_ignore=args.tracing_ignore or None,
        trust_remote_code=model.trust_remote_code,
    )
