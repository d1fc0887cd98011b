"""validate: every check compress-model makes before calibrating, in seconds, with no weights.

Run it on a deployment's parameters before scheduling it. It runs the flow's own check sequence
(`flows/checks.py`): renders the recipe, resolves the model (config and tokenizer only: hub
weights are not downloaded), builds the calibration dataset, checks the output folder and traces
the model on the meta device, and plans calibration's memory on this machine. The first problem raises the same error the flow would, naming
the field and the fix.

From the shell: `compressflow validate params.yaml` or `compressflow validate --deployment NAME`.
"""

from __future__ import annotations

import time
from typing import Any

from compressflow.flows.checks import check_before_calibration, check_output, resolve_inputs
from compressflow.manifest import find_published
from compressflow.params import CalibrationArgs, DatasetArgs, ModelArgs, OutputArgs, RecipeArgs
from compressflow.results import Check, ValidationReport
from compressflow.tasks.adapt_recipe import adapt_recipe
from compressflow.tasks.build_dataset import build_dataset
from compressflow.tasks.check_traceability import check_traceability
from compressflow.tasks.fetch_model import fetch_model
from compressflow.tasks.plan_memory import plan_memory
from compressflow.tasks.render_recipe import render_recipe

# What each check's row says about its result.
DESCRIBE = {
    render_recipe: ("recipe", lambda r: f"{', '.join(r.modifiers)}; pipeline {r.pipeline}"),
    fetch_model: ("model", lambda m: f"{m.source}: {m.identity}"),
    adapt_recipe: (
        "architecture",
        lambda r: "; ".join(r.notes) or f"{r.architecture}: no changes",
    ),
    build_dataset: (
        "dataset",
        lambda d: (
            f"{d.num_samples} samples, {d.token_stats['total']:.0f} tokens" if d else "not needed"
        ),
    ),
    check_output: ("output", str),
    plan_memory: ("memory", lambda plan: plan.summary()),
    check_traceability: (
        "traceability",
        lambda t: f"{t.subgraphs} subgraphs" if t.checked else f"skipped: {t.reason}",
    ),
}


class _TimedChecks:
    """A runner for the shared sequence: calls each stage's function directly and times it."""

    def __init__(self):
        self.checks: list[Check] = []

    def run(self, stage, *args):
        started = time.perf_counter()
        result = getattr(stage, "fn", stage)(*args)
        name, describe = DESCRIBE[stage]
        seconds = round(time.perf_counter() - started, 3)
        self.checks.append(Check(name=name, seconds=seconds, detail=describe(result)))
        return result


def validate(
    model: ModelArgs | dict[str, Any],
    dataset: DatasetArgs | dict[str, Any] | None = None,
    recipe: RecipeArgs | dict[str, Any] | None = None,
    output: OutputArgs | dict[str, Any] | None = None,
    calibration: CalibrationArgs | dict[str, Any] | None = None,
) -> ValidationReport:
    """Run the flow's pre-calibration checks; raise the first problem, or report what passed."""
    model = ModelArgs.model_validate(model)
    dataset = DatasetArgs.model_validate(dataset or {})
    recipe = RecipeArgs.model_validate(recipe or {})
    output = OutputArgs.model_validate(output or {})
    calibration = CalibrationArgs.model_validate(calibration or {})

    timed = _TimedChecks()
    inputs = resolve_inputs(timed.run, model, dataset, recipe, output, calibration, weights=False)
    check_before_calibration(timed.run, inputs, recipe, output, calibration)
    return ValidationReport(
        checks=timed.checks,
        output_path=str(inputs.target),
        reuses_output=find_published(inputs.target, inputs.key) is not None,
    )
