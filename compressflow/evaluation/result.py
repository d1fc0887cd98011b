"""What evaluate-model and sweep-recipe return: scores, served performance, the report, a
sweep's points."""

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


# Figures `vllm bench serve` reports, by our name: (its JSON key, unit, better higher).
SERVED_METRICS: dict[str, tuple[str, str, bool]] = {
    "output_throughput": ("output_throughput", "tokens/s", True),
    "ttft_p50": ("p50_ttft_ms", "ms", False),
    "ttft_p95": ("p95_ttft_ms", "ms", False),
    "itl_p50": ("p50_itl_ms", "ms", False),
    "itl_p95": ("p95_itl_ms", "ms", False),
}


class ServedFigure(BaseModel):
    """One metric over the repeats: its median and spread."""

    median: float
    low: float = Field(description="Smallest value over the repeats.")
    high: float = Field(description="Largest value over the repeats.")
    values: list[float] = Field(description="Each repeat's value, in the order measured.")


class ServedLevel(BaseModel):
    """Both models at one concurrency level."""

    concurrency: int
    base: dict[str, ServedFigure] = Field(description="By SERVED_METRICS name.")
    compressed: dict[str, ServedFigure] = Field(description="By SERVED_METRICS name.")
    throughput_ratio: float = Field(
        description="Median output throughput, compressed over base (above 1: faster)."
    )
    verdict: Literal["faster", "slower", "no measurable difference"] = Field(
        description="'no measurable difference' where the throughputs' spreads overlap."
    )


class ServedPerformance(BaseModel):
    """What serving the compressed model buys against its base, both served by vLLM with the
    same flags (the evaluation's served-performance stage)."""

    status: Literal["measured", "not measured here", "failed"]
    reason: str = Field(default="", description="Why not measured or failed; vLLM's own words.")
    device: str = Field(default="", description="The device served on, e.g. 'NVIDIA H100 80GB'.")
    backend: str = Field(
        default="", description="vLLM's version and platform, e.g. 'vLLM 0.32.0 (CPU)'."
    )
    kernels: dict[str, str] = Field(
        default_factory=dict,
        description="{'base' | 'compressed': the linear kernel vLLM reported choosing}.",
    )
    serve_flags: list[str] = Field(
        default_factory=list, description="The `vllm serve` flags both models ran with."
    )
    workload: dict[str, Any] = Field(
        default_factory=dict,
        description="The ServedArgs measured (lengths, levels, repeats, seed).",
    )
    levels: list[ServedLevel] = Field(default_factory=list)
    weights_memory_gib: dict[str, float] = Field(
        default_factory=dict, description="{'base' | 'compressed': the weights' memory}."
    )
    weights_memory_source: str = Field(
        default="",
        description="Where weights_memory_gib comes from: vLLM's report (GPU runners), or the "
        "checkpoint's tensors at the served dtype where vLLM reports none (vLLM-CPU).",
    )
    kv_cache_tokens: dict[str, int] = Field(
        default_factory=dict,
        description="{'base' | 'compressed': KV-cache capacity vLLM reported}; GPU only (vLLM-CPU "
        "sizes its cache by a setting, so there it is not a result).",
    )
    seconds: float = Field(default=0.0, description="Serving and measuring both models.")

    def highest_level(self) -> ServedLevel | None:
        """The highest concurrency measured: the level gate.min_speedup judges and the
        headlines quote; None when none was measured."""
        return max(self.levels, key=lambda level: level.concurrency, default=None)


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
    served: ServedPerformance | None = Field(
        default=None, description="Served speed and memory; None: not asked for (served.measure)."
    )
    breaches: list[str] = Field(description="Thresholds passed; empty when within limits.")
    flags: list[str] = Field(
        default_factory=list,
        description="Limits the gate could not judge (served speed not measured here, failed, "
        "or inside its spread): warnings, never failures.",
    )
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
