"""The compress-model flow: model + calibration data + recipe -> a vLLM-ready checkpoint.

Cheap checks run first (the recipe renders before anything is downloaded; the output folder is
checked before calibration), so mistakes fail in seconds. A run whose inputs match an output
already published returns it without calibrating again.
"""

from __future__ import annotations

import shutil

from prefect import flow
from prefect.logging import get_run_logger

from flows.params import DatasetArgs, ModelArgs, OutputArgs, RecipeArgs, TrackingArgs
from flows.stages import Stages
from tasks.tracking import track_flow_run
from tasks.build_dataset import build_dataset
from tasks.calibrate import calibrate
from tasks.check_traceability import check_traceability
from tasks.disk_space import check_free_space
from tasks.events import emit_published
from tasks.fetch_model import fetch_model
from tasks.output_lock import output_lock
from tasks.publish import (
    PublishedModel,
    check_target,
    find_published,
    output_path,
    publish,
    remove_stale_staging,
    run_key,
    staging_path,
)
from tasks.render_recipe import render_recipe


def default_task_name(model: ModelArgs, recipe: RecipeArgs) -> str:
    preset = recipe.recipe if isinstance(recipe.recipe, str) and "\n" not in recipe.recipe else "custom"
    return f"{model.model_id.rstrip('/').rsplit('/', 1)[-1]} {preset}"


# Results persist so callers of the deployment (sweeps) can read the PublishedModel back.
@flow(name="compress-model", persist_result=True)
def compress(
    model: ModelArgs,
    dataset: DatasetArgs = DatasetArgs(),
    recipe: RecipeArgs = RecipeArgs(),
    output: OutputArgs = OutputArgs(),
    tracking: TrackingArgs = TrackingArgs(),
) -> PublishedModel:
    """Compress `model` with `recipe`, calibrated on `dataset`, and publish it to `output`."""
    inputs = {
        "model": model.model_dump(),
        "dataset": dataset.model_dump(),
        "recipe": recipe.model_dump(),
        "output": output.model_dump(),
    }
    with track_flow_run(tracking, default_task_name(model, recipe), output.tags, inputs) as tracker:
        published = run_stages(model, dataset, recipe, output, inputs)
        # Emitted for new and reused outputs alike: tasks/events.py says why.
        emit_published(published, model, output.auto_evaluate)
    if tracker.failures:
        get_run_logger().warning("ClearML tracking failed: %s", "; ".join(tracker.failures))
    return published.model_copy(update={"tracking": tracker.status()})


def run_stages(
    model: ModelArgs, dataset: DatasetArgs, recipe: RecipeArgs, output: OutputArgs, inputs: dict
) -> PublishedModel:
    """The pipeline: cheap stages first, so mistakes fail before any weights load."""
    log = get_run_logger()
    stages = Stages()
    rendered = stages.run(render_recipe, recipe)
    fetched = stages.run(fetch_model, model)
    built = stages.run(build_dataset, dataset, fetched, rendered.needs_data)

    key = run_key(fetched, built, rendered, recipe, output)
    target = output_path(output, fetched, rendered)
    # One writer per output: a second run waits here, then reuses what the first published
    # (same inputs) or is refused by check_target (another model).
    with output_lock(target, log):
        if existing := find_published(target, key):
            log.info("Reusing %s: it was published from the same model, data and recipe", target)
            return existing.model_copy(update={"stages": stages.records})
        check_target(target, key, output.overwrite)
        remove_stale_staging(target)
        check_free_space(target.parent, fetched, rendered.scheme, output.save_compressed, log)

        stages.run(check_traceability, fetched, rendered, built, recipe)
        staging = staging_path(target)
        try:
            calibration = stages.run(
                calibrate,
                fetched,
                built,
                rendered,
                recipe,
                str(staging),
                output.save_compressed,
                dataset.data_collator,
            )
            published = stages.run(
                publish, calibration, fetched, built, rendered, str(target), key, inputs, output,
                stages.as_dicts(),
            )  # fmt: skip
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # gone already when publishing succeeded
    return published.model_copy(update={"stages": stages.records})
