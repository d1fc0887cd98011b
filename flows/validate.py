"""validate: every check compress-model makes before calibrating, in seconds, with no weights.

Run it on a deployment's parameters before scheduling it. It runs the flow's own check sequence
(`flows/checks.py`): first what the files decide with no library imported, in this process
(`precheck`: a refusal in about 2 s, before the forkserver starts), then renders the recipe,
resolves the model (config and tokenizer only: hub weights are not downloaded), builds the
calibration dataset, checks the output folder and traces the model on the meta device, and plans
calibration's memory on this machine. The parameters' shape is checked first, every group's
problems at once; after that the first problem raises the same error the flow would, naming the
field and the fix.

From the shell: `compressflow validate params.yaml` or `compressflow validate --deployment NAME`.
"""

from __future__ import annotations

import inspect
import time
from typing import Any, get_type_hints

from pydantic import BaseModel, ConfigDict, create_model

from compressflow.flows.checks import (
    check_before_calibration,
    check_output,
    check_weights,
    resolve_inputs,
)
from compressflow.flows.compress import compress
from compressflow.inputs import InputCheck, RunArgs, ValidationReport
from compressflow.params import (
    CalibrationArgs,
    DatasetArgs,
    ModelArgs,
    OutputArgs,
    RecipeArgs,
    TargetArgs,
)
from compressflow.runtime.stages import boundary
from compressflow.settings import check_settings
from compressflow.store.output import find_published, find_uploaded, holds_nothing
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
    check_weights: ("weights", str),
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
        self.checks: list[InputCheck] = []

    def run(self, stage, *args):
        started = time.perf_counter()
        name, describe = DESCRIBE[stage]
        with boundary(name):  # the flow's: what no check knows of is a defect, not raw words
            result = getattr(stage, "fn", stage)(*args)
        seconds = round(time.perf_counter() - started, 3)
        self.checks.append(InputCheck(name=name, seconds=seconds, detail=describe(result)))
        return result


def validate(
    model: ModelArgs | dict[str, Any],
    dataset: DatasetArgs | dict[str, Any] | None = None,
    recipe: RecipeArgs | dict[str, Any] | None = None,
    output: OutputArgs | dict[str, Any] | None = None,
    calibration: CalibrationArgs | dict[str, Any] | None = None,
    target: TargetArgs | dict[str, Any] | None = None,
) -> ValidationReport:
    """Run the flow's pre-calibration checks; raise the first problem, or report what passed.

    The groups are validated first, together: one ValidationError lists every group's problems.
    """
    given = dict(
        model=model,
        dataset=dataset,
        recipe=recipe,
        output=output,
        calibration=calibration,
        target=target,
    )
    params = Parameters.model_validate(
        {name: value for name, value in given.items() if value is not None}
    )

    check_settings()  # as compress-model does first
    timed = _TimedChecks()
    with boundary("validate"):  # what escapes between the checks' own boundaries
        inputs = resolve_inputs(timed.run, RunArgs(**dict(params)), weights=False)
        check_before_calibration(timed.run, inputs)
        reuses = find_published(inputs.target, inputs.key) is not None
        output = inputs.args.output
        if not reuses and output.upload_uri and holds_nothing(inputs.target):  # as the flow
            reuses = find_uploaded(output, inputs.key) is not None
    return ValidationReport(
        checks=timed.checks, output_path=str(inputs.target), reuses_output=reuses
    )


# compress-model's parameter groups and their models, read from its signature so they cannot drift.
FLOW_GROUPS: dict[str, type[BaseModel]] = {
    name: hint for name, hint in get_type_hints(compress.fn).items() if name != "return"
}


def _parameters() -> type[BaseModel]:
    """The groups `validate` checks as one model, with the flow's defaults: validating it reports
    every group's errors at once (locations start with the group), and unknown groups too."""
    flow = inspect.signature(compress.fn).parameters
    fields = {
        name: (
            FLOW_GROUPS[name],
            ... if flow[name].default is inspect.Parameter.empty else flow[name].default,
        )
        for name in inspect.signature(validate).parameters
    }
    # Inputs stay out of the printed errors: a `*_block` field may hold a pasted secret.
    config = ConfigDict(extra="forbid", hide_input_in_errors=True)
    return create_model("Parameters", __config__=config, **fields)


Parameters = _parameters()
