"""The compress-model flow: model + calibration data + recipe -> a vLLM-ready checkpoint.

Cheap checks run first (the recipe renders before anything is downloaded; the output folder and
the upload URI are checked before calibration), so mistakes fail in seconds. A run whose inputs
match an output already published returns it without calibrating again: the local folder's, or
on a worker without it, the one uploaded to `output.upload_uri`. With an upload URI, the
published folder is then committed there (tasks/upload.py), and the run returns its URI. Calibration is the target strategy's
that applies (flows/strategies.py): the recipe as asked, or with a quality target, a search that
calibrates again with modules left unquantized (tasks/search_target.py) or a mix of precisions
(tasks/mix_precision.py); the calibration it chooses goes on to verify and publish.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from prefect import flow

from compressflow.calibration.resume import discard
from compressflow.flows.checks import check_before_calibration, resolve_inputs
from compressflow.flows.opening import opened
from compressflow.flows.strategies import Calibrations, choose
from compressflow.inputs import RunArgs
from compressflow.logs import run_logger
from compressflow.model.serving import require_vllm
from compressflow.params import (
    CalibrationArgs,
    DatasetArgs,
    ModelArgs,
    OutputArgs,
    RecipeArgs,
    TargetArgs,
    TrackingArgs,
    VerifyArgs,
)
from compressflow.reporting.lineage import (
    add_run_tags,
    compress_run_name,
    current_parameters,
    materializing,
    publish_lineage,
    uploaded_asset,
)
from compressflow.reporting.summary import summarize_reused
from compressflow.results import PublishedModel
from compressflow.runtime.events import emit_published
from compressflow.runtime.gpus import gpu_slots
from compressflow.runtime.isolation import warm_up
from compressflow.runtime.stages import Stages
from compressflow.settings import check_settings
from compressflow.store.locks import output_lock
from compressflow.store.output import find_published, find_uploaded, holds_nothing
from compressflow.store.staging import remove_leftovers, remove_staging
from compressflow.tasks.build_held_out import build_held_out
from compressflow.tasks.calibrate import calibrate
from compressflow.tasks.publish import publish
from compressflow.tasks.upload import upload, upload_reused
from compressflow.tasks.verify import verify, verify_reused
from compressflow.verification.vllm import vllm_not_run


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
    target: TargetArgs = TargetArgs(),
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
        target: A quality target: the smallest configuration whose held-out perplexity stays
            within max_perplexity_ratio of the base's (0, the default: the recipe as asked).
    """
    check_settings()  # the worker's environment, before anything is opened or started
    # Then the forkserver's imports (5 s or more) overlap opening the ClearML task and the
    # cheap stages, instead of starting when the first of them needs a child.
    warm_up()
    args = RunArgs(
        model=model,
        dataset=dataset,
        recipe=recipe,
        output=output,
        verify=verify,
        calibration=calibration,
        target=target,
    )
    # The flow run only, not its task runs: Prefect asks the server for a concurrency slot of
    # every tag of every task run, which on its SQLite backend took 2 s after a long stage
    # ("database is locked", retried; docs/benchmarks/flow-vs-bare.md#prefects-tag-concurrency).
    add_run_tags([*output.tags, recipe.label()])
    with opened(
        "compress-model", tracking, compress_run_name(model, recipe), output.tags, args.recorded()
    ) as tracker:
        published = run_stages(args)
        # Emitted for new and reused outputs alike: compressflow/runtime/events.py says why.
        emit_published(published, model, output.auto_evaluate)
    if tracker.failures:
        run_logger(__name__).warning("ClearML tracking failed: %s", "; ".join(tracker.failures))
    return published.model_copy(update={"tracking": tracker.status()})


def run_stages(args: RunArgs) -> PublishedModel:
    """The pipeline: cheap stages first, so mistakes fail before any weights load."""
    log = run_logger(__name__)
    verify_args, calibration, output = args.verify, args.calibration, args.output
    require_vllm(
        "verify.vllm",
        verify_args.vllm == "required",
        "set verify.vllm to auto (check where possible) or off",
    )
    stages = Stages(timeout_fields={calibrate.name: "calibration.timeout_minutes"})
    wait_limit = calibration.timeout_minutes * 60 or None  # for a GPU slot, as for calibrating
    resolved = resolve_inputs(stages.run, args)
    target = resolved.target
    # One writer per output: a second run waits here, then reuses what the first published
    # (same inputs) or is refused by check_output (another model).
    with output_lock(target, log):
        # What killed runs left beside the output (copies of the weights, some of them).
        remove_leftovers(target)
        existing, stored = find_published(target, resolved.key), None
        if existing is None and output.upload_uri and holds_nothing(target):
            # A worker without the local copy (a fresh pod): the store's, when these inputs
            # made it. Nothing is downloaded; its path is the URI.
            existing, stored = find_uploaded(output, resolved.key) or (None, None)
        if existing:
            log.info(
                "Reusing %s: it was published from the same model, data and recipe",
                existing.path,
            )
            # vLLM's late check needs the local folder, which a reuse from the store lacks.
            if stored is None and vllm_not_run(existing, verify_args):  # vLLM arrived since
                with gpu_slots(1, wait_limit, "the vLLM check"):
                    stages.run(verify_reused, existing, resolved.model, verify_args)
            if stored is None and output.upload_uri:  # the upload complete, or completed now
                existing = stages.run(upload_reused, existing, output)
            reused = existing.model_copy(update={"stages": stages.records})
            summarize_reused(reused, stored)
            return reused
        plan = check_before_calibration(stages.run, resolved)

        held_out = None
        if args.target.wanted():  # before calibrating: a bad held-out set fails fast
            held_out = stages.run(
                build_held_out, args.target.held_out.dataset_args(), resolved.model, args.dataset
            )
        strategy = choose(resolved.recipe, args.target)  # as asked, a search or a mix
        # It keeps every staging folder this run makes (one per calibration): ours to delete.
        calibrations = Calibrations(stages, resolved, plan, held_out)
        try:
            # The run's GPUs, held from its first calibration to the end of verify: the stages
            # between (perplexity, sensitivity, the reload, vLLM) use them too, and only them.
            with gpu_slots(calibration.gpus, wait_limit, "calibration and verification"):
                calibrated, chosen, search = strategy.run(calibrations)
                verification = stages.run(
                    verify, calibrated, resolved.model, chosen, plan, verify_args, str(target)
                )
            checkpoint, upstream = publish_lineage(
                resolved.model, resolved.dataset, target, args.recipe.label()
            )
            published = stages.run(
                materializing(publish, checkpoint, upstream, by="llm-compressor"),
                resolved.with_recipe(chosen),
                calibrated,
                plan,
                verification,
                list(stages.records),
                search,
            )
            if plan.checkpoint_folder:  # published: nothing left to resume
                discard(Path(plan.checkpoint_folder))
            if output.upload_uri:  # the artifact upload: the sealed folder, as a commit
                stored_asset = uploaded_asset(output.upload_uri, args.recipe.label())
                published = stages.run(
                    materializing(upload, stored_asset, [checkpoint], by="compressflow"),
                    published,
                    output,
                    list(stages.records),
                )
        finally:
            # The published one is gone already (renamed); the reference logits never published.
            for staging in calibrations.stagings:
                remove_staging(staging)
            if plan.offload_folder and not calibration.offload_folder:  # ours, not the user's
                shutil.rmtree(plan.offload_folder, ignore_errors=True)
    return published.model_copy(update={"stages": stages.records})
