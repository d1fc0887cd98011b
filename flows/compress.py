"""The compress-model flow: model + calibration data + recipe -> a vLLM-ready checkpoint.

Cheap checks run first (the recipe renders before anything is downloaded; the output folder is
checked before calibration), so mistakes fail in seconds. A run whose inputs match an output
already published returns it without calibrating again.
"""

from __future__ import annotations

import shutil

from prefect import flow, tags

from compressflow.blocks.clearml_settings import load_clearml_settings
from compressflow.flows.checks import check_before_calibration, resolve_inputs
from compressflow.logs import run_logger
from compressflow.model.serving import require_vllm
from compressflow.params import (
    CalibrationArgs,
    DatasetArgs,
    ModelArgs,
    OutputArgs,
    RecipeArgs,
    TrackingArgs,
    VerifyArgs,
)
from compressflow.reporting.lineage import (
    add_run_tags,
    compress_run_name,
    current_parameters,
    materializing,
    publish_lineage,
)
from compressflow.reporting.tracking import track_flow_run
from compressflow.results import PublishedModel
from compressflow.runtime.events import emit_published
from compressflow.runtime.isolation import warm_up
from compressflow.runtime.stages import Stages
from compressflow.store.locks import output_lock
from compressflow.store.manifest import (
    compile_cache_path,
    find_published,
    reference_path,
    remove_leftovers,
    staging_path,
)
from compressflow.tasks.calibrate import calibrate, calibrate_here
from compressflow.tasks.publish import publish, summarize_reused
from compressflow.tasks.verify import verify


def run_name() -> str:
    parameters = current_parameters()
    return compress_run_name(parameters["model"], parameters.get("recipe"))


# Results persist so callers of the deployment (sweeps) can read the PublishedModel back.
@flow(name="compress-model", persist_result=True, flow_run_name=run_name)
def compress(
    model: ModelArgs,
    dataset: DatasetArgs = DatasetArgs(),
    recipe: RecipeArgs = RecipeArgs(),
    output: OutputArgs = OutputArgs(),
    tracking: TrackingArgs = TrackingArgs(),
    verify: VerifyArgs = VerifyArgs(),
    calibration: CalibrationArgs = CalibrationArgs(),
) -> PublishedModel:
    """Compress `model` with `recipe`, calibrated on `dataset`, verify it, publish it to `output`.

    Args:
        model: The model to compress: a hub id, a local folder or a ClearML model.
        dataset: Calibration data: where the text comes from and how much of it.
        recipe: What to do to the model: a preset, or a recipe of your own.
        output: Where the compressed model is published, and its tags.
        tracking: Where the run is logged in ClearML.
        verify: The checks the compressed model must pass before it is published.
        calibration: How calibration runs; the defaults need no tuning.
    """
    inputs = {
        "model": model.model_dump(),
        "dataset": dataset.model_dump(),
        "recipe": recipe.model_dump(),
        "output": output.model_dump(),
        "verify": verify.model_dump(),
        "calibration": calibration.model_dump(),
    }
    run_tags = add_run_tags([*output.tags, recipe.label()])
    with (
        tags(*run_tags),
        track_flow_run(
            tracking,
            load_clearml_settings(tracking.clearml_block),
            compress_run_name(model, recipe),
            output.tags,
            inputs,
        ) as tracker,
    ):
        published = run_stages(model, dataset, recipe, output, verify, calibration, inputs)
        # Emitted for new and reused outputs alike: compressflow/runtime/events.py says why.
        emit_published(published, model, output.auto_evaluate)
    if tracker.failures:
        run_logger(__name__).warning("ClearML tracking failed: %s", "; ".join(tracker.failures))
    return published.model_copy(update={"tracking": tracker.status()})


def run_stages(
    model: ModelArgs,
    dataset: DatasetArgs,
    recipe: RecipeArgs,
    output: OutputArgs,
    verify_args: VerifyArgs,
    calibration: CalibrationArgs,
    inputs: dict,
) -> PublishedModel:
    """The pipeline: cheap stages first, so mistakes fail before any weights load."""
    log = run_logger(__name__)
    require_vllm(
        "verify.vllm",
        verify_args.vllm == "required",
        "set verify.vllm to auto (check where possible) or off",
    )
    stages = Stages()
    warm_up(calibrate_here)  # calibration's process forks from it; imports overlap cheap stages
    resolved = resolve_inputs(stages.run, model, dataset, recipe, output, calibration)
    target = resolved.target
    # One writer per output: a second run waits here, then reuses what the first published
    # (same inputs) or is refused by check_output (another model).
    with output_lock(target, log):
        # What killed runs left beside the output (copies of the weights, some of them).
        remove_leftovers(target)
        if existing := find_published(target, resolved.key):
            log.info("Reusing %s: it was published from the same model, data and recipe", target)
            reused = existing.model_copy(update={"stages": stages.records})
            summarize_reused(reused)
            return reused
        plan = check_before_calibration(stages.run, resolved, recipe, output, calibration)

        staging = staging_path(target)
        try:
            timeout = calibration.timeout_minutes * 60 or None
            calibrated = stages.run(
                calibrate.with_options(timeout_seconds=timeout),
                resolved.model,
                resolved.dataset,
                resolved.recipe,
                recipe,
                plan,
                str(staging),
                verify_args,
                output.save_compressed,
                dataset.data_collator,
            )
            verification = stages.run(
                verify, calibrated, resolved.model, resolved.recipe, plan, verify_args, str(target)
            )
            checkpoint, upstream = publish_lineage(
                resolved.model, resolved.dataset, target, recipe.label()
            )
            published = stages.run(
                materializing(publish, checkpoint, upstream, by="llm-compressor"),
                calibrated,
                plan,
                verification,
                resolved.model,
                resolved.dataset,
                resolved.recipe,
                str(target),
                resolved.key,
                inputs,
                output,
                list(stages.records),
            )
        finally:
            # Gone already when publishing succeeded; the reference logits are never published.
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(compile_cache_path(staging), ignore_errors=True)
            reference_path(staging).unlink(missing_ok=True)
            if plan.offload_folder and not calibration.offload_folder:  # ours, not the user's
                shutil.rmtree(plan.offload_folder, ignore_errors=True)
    return published.model_copy(update={"stages": stages.records})
