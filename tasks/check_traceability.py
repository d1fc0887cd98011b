"""Check traceability: traces the model on the meta device before any weights are loaded.

The trace and the checks of the recipe's shapes against the model live in
`compressflow.model.tracing`; the calibration sample the trace takes is read by
`compressflow.data.build`, joined by `compressflow.calibration.run.trace_for_pipeline`.
This module runs them in a child and reports what they found.
"""

from __future__ import annotations

from prefect import task

from compressflow.calibration.run import trace_for_pipeline
from compressflow.errors import TraceabilityError
from compressflow.logs import run_logger
from compressflow.model.tracing import check_shapes
from compressflow.params import RecipeArgs
from compressflow.reporting import tracking
from compressflow.results import BuiltDataset, FetchedModel, RenderedRecipe, TraceReport
from compressflow.runtime.isolation import in_child


@task(name="check traceability")
def check_traceability(
    model: FetchedModel, recipe: RenderedRecipe, dataset: BuiltDataset | None, args: RecipeArgs
) -> TraceReport:
    """Trace the model as the sequential pipeline will, or say why no trace is needed."""
    logger = run_logger(__name__)
    tracker = tracking.current()
    in_child(check_shapes, model, recipe)

    # render_recipe resolves 'independent' to what it runs ('sequential' for data modifiers).
    if recipe.pipeline != "sequential":
        why = "data-free recipe" if not recipe.needs_data else f"the {recipe.pipeline} pipeline"
        report = TraceReport(checked=False, reason=f"skipped: {why} does not trace the model")
        logger.info("Traceability check %s", report.reason)
        tracker.params("traceability", {"checked": False, "reason": report.reason})
        return report

    if dataset is None:
        raise TraceabilityError(
            "dataset.text_samples",
            "the sequential pipeline needs calibration data and none was built",
            "set dataset.text_samples above 0, or use recipe.pipeline 'datafree' for a data-free "
            "recipe",
        )

    try:
        report = in_child(trace_for_pipeline, model, recipe, dataset, args)
    except TraceabilityError as exc:
        logger.error("Traceability check failed: %s", exc)
        tracker.params("traceability", {"checked": False, "error": str(exc)})
        tracker.text(f"Traceability check failed: {exc}")
        raise

    logger.info(
        "Traceability check: %s in %.2f s (peak RSS %.0f MB, +%.0f MB); targets=%s",
        report.reason,
        report.seconds,
        report.peak_rss_mb,
        report.rss_growth_mb,
        report.sequential_targets,
    )
    tracker.params(
        "traceability",
        {
            "checked": True,
            "subgraphs": report.subgraphs,
            "seconds": report.seconds,
            "peak_rss_mb": report.peak_rss_mb,
            "sequential_targets": report.sequential_targets,
        },
    )
    return report
