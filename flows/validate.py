"""validate: every check compress-model makes before calibrating, in seconds, with no weights.

Run it on a deployment's parameters before scheduling it: it renders the recipe, resolves the
model (config and tokenizer only: hub weights are not downloaded), builds the calibration
dataset, traces the model on the meta device and checks the output folder, in the flow's order.
The first problem raises the same error the flow would, naming the field and the fix.

From the shell: `compressflow validate params.yaml` or `compressflow validate --deployment NAME`.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel

from flows.params import DatasetArgs, ModelArgs, OutputArgs, RecipeArgs
from tasks.build_dataset import build_dataset
from tasks.check_traceability import check_traceability
from tasks.fetch_model import fetch
from tasks.publish import check_target, find_published, output_path, run_key
from tasks.render_recipe import render_recipe


class Check(BaseModel):
    name: str
    seconds: float
    detail: str


class ValidationReport(BaseModel):
    checks: list[Check]
    output_path: str
    reuses_output: bool

    def table(self) -> str:
        rows = [f"  {c.name:<14} {c.seconds:6.2f} s  {c.detail}" for c in self.checks]
        return "\n".join(["Parameters are valid:", *rows])


def _check(checks: list[Check], name: str, describe, fn, *args, **kwargs):
    started = time.perf_counter()
    result = fn(*args, **kwargs)
    checks.append(Check(name=name, seconds=round(time.perf_counter() - started, 3), detail=describe(result)))
    return result


def validate(
    model: ModelArgs | dict[str, Any],
    dataset: DatasetArgs | dict[str, Any] | None = None,
    recipe: RecipeArgs | dict[str, Any] | None = None,
    output: OutputArgs | dict[str, Any] | None = None,
) -> ValidationReport:
    """Run the flow's pre-calibration checks; raise the first problem, or report what passed."""
    model = ModelArgs.model_validate(model)
    dataset = DatasetArgs.model_validate(dataset or {})
    recipe = RecipeArgs.model_validate(recipe or {})
    output = OutputArgs.model_validate(output or {})

    checks: list[Check] = []
    rendered = _check(
        checks, "recipe", lambda r: f"{', '.join(r.modifiers)}; pipeline {r.pipeline}",
        render_recipe.fn, recipe,
    )  # fmt: skip
    fetched = _check(
        checks, "model", lambda m: f"{m.source}: {m.identity}", fetch, model, weights=False
    )
    built = _check(
        checks, "dataset",
        lambda d: f"{d.num_samples} samples, {d.token_stats['total']:.0f} tokens" if d else "not needed",
        build_dataset.fn, dataset, fetched, rendered.needs_data,
    )  # fmt: skip
    _check(
        checks, "traceability",
        lambda t: f"{t.subgraphs} subgraphs" if t.checked else f"skipped: {t.reason}",
        check_traceability.fn, fetched, rendered, built, recipe,
    )  # fmt: skip
    target = output_path(output, fetched, rendered)
    key = run_key(fetched, built, rendered, recipe, output)
    _check(checks, "output", lambda _: str(target), check_target, target, key, output.overwrite)
    return ValidationReport(
        checks=checks,
        output_path=str(target),
        reuses_output=find_published(target, key) is not None,
    )
