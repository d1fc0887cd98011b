"""Plan memory: where calibration keeps the weights, and a refusal in seconds of what cannot fit.

The plan comes from the config and the worker's free memory (compressflow.model.memory says how); it is
logged, written to ClearML and the manifest, and handed to calibrate, which loads the model the
way it says. It is never cached: the same inputs on another worker plan differently.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from compressflow.logs import run_logger
from compressflow.model.memory import plan_for
from compressflow.params import CalibrationArgs, RecipeArgs
from compressflow.reporting import tracking
from compressflow.results import BuiltDataset, FetchedModel, MemoryPlan, RenderedRecipe
from compressflow.runtime.isolation import in_child


@task(name="plan memory", cache_policy=NO_CACHE)
def plan_memory(
    model: FetchedModel,
    recipe: RenderedRecipe,
    dataset: BuiltDataset | None,
    recipe_args: RecipeArgs,
    args: CalibrationArgs,
    target: str,
) -> MemoryPlan:
    """Plan calibration's memory for this worker; ResourceError when nothing fits."""
    plan = in_child(
        plan_for, model, recipe, dataset, args, Path(target), recipe_args.sequential_targets
    )
    log = run_logger(__name__)
    log.info("Memory plan: %s", plan.summary())
    for note in plan.notes:
        log.info("Memory plan: %s", note)
    tracking.log_result(plan)
    return plan
