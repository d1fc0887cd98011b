"""What evaluate-model and sweep-recipe return: scores, the report, a sweep's points."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from compressflow.evaluation.args import METRICS
from compressflow.verification.result import QualityMetrics


class LmEvalScores(BaseModel):
    """One model's lm-eval-harness figures (the run_lm_eval stage)."""

    backend: str = Field(
        description="lm-eval's model backend that ran: 'vllm' or 'hf' (transformers)."
    )
    lm_eval_version: str
    metrics: dict[str, float] = Field(description="{'<task>/<metric>': value}.")
    higher_is_better: dict[str, bool] = Field(description="Per metric: whether higher is better.")
    seconds: float = Field(description="Loading the model and running every task.")


class EvaluationReport(BaseModel):
    """What evaluate-model returns. It lives here, not in the flow module: a worker loads the flow
    file by path (as module `evaluate`), and a result pickled from there would not unpickle
    in the process that reads it (e.g. a sweep)."""

    compressed_path: str
    base_identity: str
    scheme: str | None
    held_out_source: str
    excluded_calibration_samples: int
    metrics: QualityMetrics
    lm_eval: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="{'base' | 'compressed': {'<task>/<metric>': value}}."
    )
    lm_eval_backend: str | None = Field(
        default=None, description="lm-eval's backend that scored both models; None: not run."
    )
    lm_eval_recovery: dict[str, float] = Field(
        default_factory=dict,
        description="{'<task>/<metric>': recovery %}: compressed over base, base over compressed "
        "for metrics better lower (perplexities), so 100 is no loss.",
    )
    breaches: list[str] = Field(description="Thresholds passed; empty when within limits.")
    passed: bool
    tracking: str | None = Field(default=None, description="Where ClearML logged the run.")


class Point(BaseModel):
    recipe_args: dict[str, Any]
    text_samples: int

    def label(self) -> str:
        values = {**self.recipe_args, "text_samples": self.text_samples}
        return ", ".join(f"{name}={value}" for name, value in values.items())


class PointResult(BaseModel):
    point: Point
    status: Literal["completed", "failed"]
    metrics: dict[str, float] = Field(default_factory=dict)
    objective: float | None = None
    output_path: str | None = None
    runs: dict[str, str] = Field(default_factory=dict, description="Flow run names by stage.")
    error: str | None = None

    def row(self) -> dict:
        return {
            "point": self.point.label(),
            "status": self.status,
            "objective": self.objective,
            **{name: self.metrics.get(name) for name in METRICS},
            "output": self.output_path,
            "runs": ", ".join(f"{stage}: {name}" for stage, name in self.runs.items()),
            "error": self.error,
        }


class SweepReport(BaseModel):
    results: list[PointResult] = Field(description="Completed points best first, then failures.")
    best: PointResult | None
