"""The sweep-recipe flow: grid or random search over recipe_args and dataset sizes.

Each point of the search is one compress-model run and one evaluate-model run, started as
deployment runs, so a work pool with several GPU workers runs points side by side and a single
worker runs them one after another. The sweep itself only waits: run it where it takes no GPU
slot (from a laptop, or a deployment on a CPU pool), never on the pool its points need.

Shared work is done once: before dispatching, the sweep fetches the model and builds each
distinct calibration dataset with the very cached tasks compress-model runs, so every point's
runs reuse them (the cache lives in Prefect's result storage: on several hosts, point
PREFECT_DEFAULT_RESULT_STORAGE_BLOCK at shared storage). Each point is a cached task: a rerun of
the same sweep skips the points that completed and runs the rest (tasks/sweep_point.py). A point
that fails is recorded in its row and does not stop the others.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_table_artifact

from compressflow.flows.checks import local_data, sources_read
from compressflow.flows.opening import opened
from compressflow.inputs import RunArgs
from compressflow.logs import run_logger
from compressflow.model.folder_checks.files import local_folder
from compressflow.params import (
    METRICS,
    DatasetArgs,
    Deployments,
    HeldOutArgs,
    ModelArgs,
    Objective,
    OutputArgs,
    RecipeArgs,
    SearchSpace,
    TrackingArgs,
)
from compressflow.reporting.artifacts import artifact_key, metric_value
from compressflow.reporting.lineage import compress_run_name, current_parameters
from compressflow.results import Point, PointResult, SweepReport
from compressflow.runtime.stages import Stages
from compressflow.settings import check_settings
from compressflow.store.identity import point_key
from compressflow.store.output import check_apart
from compressflow.tasks.build_dataset import build_dataset
from compressflow.tasks.fetch_model import fetch_model
from compressflow.tasks.render_recipe import render_recipe
from compressflow.tasks.sweep_point import run_point


def expand(space: SearchSpace, default_samples: int) -> list[Point]:
    """The points of `space`: every combination, or `budget` of them drawn with `seed`."""
    names = list(space.recipe_args)
    combos = [
        Point(recipe_args=dict(zip(names, values, strict=True)), text_samples=samples)
        for samples in (space.text_samples or [default_samples])
        for values in itertools.product(*(space.recipe_args[name] for name in names))
    ]
    if space.strategy == "random" and 0 < space.budget < len(combos):
        combos = random.Random(space.seed).sample(combos, space.budget)
    return combos


def rank(results: list[PointResult], objective: Objective) -> list[PointResult]:
    """Completed points best first by the objective, then the failed ones."""
    done = sorted(
        (r for r in results if r.status == "completed"),
        key=lambda r: r.objective,
        reverse=objective.direction == "maximize",
    )
    return done + [r for r in results if r.status == "failed"]


def ranking_rows(ranked: list[PointResult], metric: str) -> list[dict]:
    """The ranking as a person reads it: each metric rounded and with its unit."""
    return [
        {
            **result.row(),
            "objective": metric_value(metric, result.objective),
            **{name: metric_value(name, result.metrics.get(name)) for name in METRICS},
        }
        for result in ranked
    ]


def point_params(
    point: Point, model: ModelArgs, dataset: DatasetArgs, recipe: RecipeArgs, output_root: Path
) -> dict:
    return {
        "model": model.model_dump(),
        "dataset": {**dataset.model_dump(), "text_samples": point.text_samples},
        "recipe": {
            **recipe.model_dump(),
            "recipe_args": {**recipe.recipe_args, **point.recipe_args},
        },
        "output": OutputArgs(
            save_directory=str(point_folder(output_root, point)),
            tags=["sweep"],
            auto_evaluate=False,  # the sweep evaluates its points itself
        ).model_dump(),
    }


def point_folder(output_root: Path, point: Point) -> Path:
    """Where `point`'s compress run publishes."""
    return output_root / f"point-{point_key(point)}"


def check_points_apart(
    root: Path, points: list[Point], args: RunArgs, held_out: HeldOutArgs
) -> None:
    """Refuse, before any point starts, an `output_root` that puts a point's output in, on or
    around a file or folder its runs read (each point's compress run would refuse it anyway,
    one failed run a point)."""
    sources = sources_read(args, local_folder(args.model))
    if (text := local_data(held_out)) is not None:  # evaluate-model reads it, each point
        sources.append(("the held-out text (held_out.dataset_name)", text))
    for point in points:
        check_apart(point_folder(root, point), sources, field="output_root")


def run_name() -> str:
    parameters = current_parameters()
    return "sweep " + compress_run_name(parameters["model"], parameters.get("recipe"))


@flow(name="sweep-recipe", flow_run_name=run_name)
def sweep(
    model: ModelArgs,
    output_root: str,
    space: SearchSpace,
    dataset: DatasetArgs = DatasetArgs(),
    recipe: RecipeArgs = RecipeArgs(),
    objective: Objective = Objective(),
    held_out: HeldOutArgs = HeldOutArgs(),
    deployments: Deployments = Deployments(),
    tracking: TrackingArgs = TrackingArgs(),
) -> SweepReport:
    """Compress and evaluate every point of `space`; rank the points by `objective`."""
    check_settings()  # the worker's environment, before anything is opened or started
    log = run_logger(__name__)
    points = expand(space, dataset.text_samples)
    root = Path(output_root).expanduser().resolve()
    check_points_apart(root, points, RunArgs(model=model, dataset=dataset, recipe=recipe), held_out)
    inputs = {
        "model": model.model_dump(),
        "space": space.model_dump(),
        "objective": objective.model_dump(),
    }
    stages = Stages()
    with opened(
        "sweep-recipe", tracking, f"sweep {model.model_id.rsplit('/', 1)[-1]}", ["sweep"], inputs
    ) as tracker:
        # Shared work, once: every point's compress run finds these in the cache.
        rendered = stages.run(
            render_recipe,
            recipe.model_copy(
                update={"recipe_args": {**recipe.recipe_args, **points[0].recipe_args}}
            ),
        )
        fetched = stages.run(fetch_model, model)
        for samples in sorted({p.text_samples for p in points}):
            stages.run(
                build_dataset,
                dataset.model_copy(update={"text_samples": samples}),
                fetched,
                rendered.needs_data,
            )

        log.info(
            "Sweeping %d point(s) over %s",
            len(points),
            ", ".join(space.recipe_args) or "text_samples",
        )
        futures = [
            (
                point,
                run_point.submit(
                    point,
                    point_params(point, model, dataset, recipe, root),
                    held_out.model_dump(),
                    objective.metric,
                    deployments.compress,
                    deployments.evaluate,
                ),
            )
            for point in points
        ]
        results = []
        for point, future in futures:
            future.wait()
            if future.state.is_completed():
                results.append(future.result())
            else:
                error = future.state.message or future.state.name
                log.warning("Point %s failed: %s", point.label(), error)
                results.append(PointResult(point=point, status="failed", error=error))

        ranked = rank(results, objective)
        best = ranked[0] if ranked and ranked[0].status == "completed" else None
        rows = [result.row() for result in ranked]
        verdict = (
            f"best: {best.point.label()} "
            f"({objective.metric} {metric_value(objective.metric, best.objective)})"
            if best
            else "no point completed"
        )
        create_table_artifact(
            ranking_rows(ranked, objective.metric),
            key=artifact_key(model.model_id, rendered.source, "sweep"),
            description=f"Sorted by {objective.metric} ({objective.direction}); {verdict}",
        )
        tracker.table("sweep results", rows)
        tracker.text(verdict)
        completed = sum(r.status == "completed" for r in results)
        log.info("Sweep done: %d/%d completed; %s", completed, len(results), verdict)
    return SweepReport(results=ranked, best=best)
