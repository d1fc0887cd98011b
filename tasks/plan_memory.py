"""Plan memory: where calibration keeps the weights, and a refusal in seconds of what cannot fit.

The plan comes from the config and the worker's free memory (compressflow.model.memory says how); it is
logged, written to ClearML and the manifest, and handed to calibrate, which loads the model the
way it says. It is never cached: the same inputs on another worker plan differently.
"""

from __future__ import annotations

import shutil

from prefect import task
from prefect.cache_policies import NO_CACHE

from compressflow.calibration.resume import checkpoint_folder
from compressflow.errors import ResourceError
from compressflow.inputs import Inputs
from compressflow.logs import run_logger
from compressflow.model import cpus
from compressflow.model.memory import plan_for
from compressflow.params import CalibrationArgs, RecipeArgs
from compressflow.reporting import tracking
from compressflow.reporting.progress import sequential_passes
from compressflow.results import BuiltDataset, MemoryPlan, RenderedRecipe, gib
from compressflow.runtime.isolation import in_child


@task(name="plan memory", cache_policy=NO_CACHE)
def plan_memory(inputs: Inputs) -> MemoryPlan:
    """Plan calibration's memory for this worker; ResourceError when nothing fits."""
    recipe, dataset, args = inputs.recipe, inputs.dataset, inputs.args.calibration
    seq_targets = inputs.args.recipe.sequential_targets
    plan = in_child(plan_for, inputs.model, recipe, dataset, args, inputs.target, seq_targets)
    plan = with_checkpoints(plan, recipe, dataset, inputs.args.recipe, args, inputs.key)
    plan = with_threads(plan, args)
    log = run_logger(__name__)
    log.info("Memory plan: %s", plan.summary())
    for note in plan.notes:
        log.info("Memory plan: %s", note)
    tracking.log_result(plan)
    return plan


def with_checkpoints(
    plan: MemoryPlan,
    recipe: RenderedRecipe,
    dataset: BuiltDataset | None,
    recipe_args: RecipeArgs,
    args: CalibrationArgs,
    run_key: str,
) -> MemoryPlan:
    """Add calibration checkpoints (compressflow.calibration.resume) where they can work, refusing
    a disk without room for them.

    Only sequential passes checkpoint: not the model-free path (no model, shard by shard), nor
    the basic pipeline (one pass over the whole model).
    """
    passes = sequential_passes(recipe.data_modifiers, recipe_args.pipeline)
    if args.checkpoint_interval_s < 0 or plan.path != "classic" or dataset is None or not passes:
        return plan
    folder = checkpoint_folder(run_key)
    # Every pass's finished layers, plus the activations between layers (old and new during
    # a save).
    needed = plan.weight_bytes * passes + plan.activation_bytes
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if free < needed:
        raise ResourceError(
            "calibration.checkpoint_interval_s",
            f"calibration checkpoints need up to {gib(needed)} under {folder.parent}, which has "
            f"{gib(free)} free",
            "free space there, point COMPRESSFLOW_CACHE_DIR at a larger disk, or set "
            "calibration.checkpoint_interval_s to -1 (no checkpoints: a crash restarts "
            "calibration from the first layer)",
        )
    return plan.model_copy(
        update={
            "checkpoint_folder": str(folder),
            "checkpoint_interval_s": args.checkpoint_interval_s,
            "checkpoint_bytes": needed,
        }
    )


def with_threads(plan: MemoryPlan, args: CalibrationArgs) -> MemoryPlan:
    """The CPU threads calibration will start with, and why (compressflow.model.cpus)."""
    if args.threads:
        threads, why = args.threads, "fixed by calibration.threads"
    else:
        # Counted as calibration will count it: the computing processes now, plus itself.
        share = cpus.share(cpus.Ledger(), joining=True)
        threads, why = share.threads, share.why
    note = f"threads: {threads} ({why})"
    return plan.model_copy(update={"threads": threads, "notes": [*plan.notes, note]})
