"""The evaluate-model flow: what a compressed model lost against its base model, and a gate on it.

Given the compressed model (the path or ClearML id compress-model published) and its base model,
it scores both on the same held-out text (perplexity of each, KL divergence of their next-token
distributions, top-1 agreement; see tasks/evaluation.py), logs them to ClearML and as a Prefect
table artifact, and fails or flags the run when the loss passes the gate's thresholds. lm-eval
tasks run on both models as well when asked for and lm-eval is installed on the worker.

The evaluate-model deployment in prefect.yaml is triggered by `compressflow.model.published`
(tasks/events.py), which fills `compressed` and `base` from the event's payload.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from prefect import flow
from prefect.artifacts import create_table_artifact
from prefect.logging import get_run_logger
from pydantic import BaseModel, ConfigDict, Field

from flows.params import IMPORT_PATH_PATTERN, DatasetArgs, ModelArgs, TrackingArgs
from tasks.errors import InputError
from tasks.evaluation import (
    EvaluationReport,
    QualityThresholdExceeded,
    base_model_args,
    breaches,
    build_held_out,
    calibration_args,
    check_lm_eval,
    compare_models,
    published_manifest,
    resolve_compressed,
    run_lm_eval,
)
from tasks.fetch_model import fetch_model
from tasks.tracking import track_flow_run


class _Args(BaseModel):
    # As in flows/params.py: an unknown key is a typo, refused rather than ignored.
    model_config = ConfigDict(extra="forbid")


class HeldOutArgs(_Args):
    dataset_name: str = Field(
        default="python_docs",
        min_length=1,
        description="Evaluation text: a dataset shortcut, hub dataset id or local file, as in "
        "compress-model's dataset. When it is the calibration dataset, the calibration samples "
        "are left out.",
    )
    dataset_config_name: str | None = Field(default=None, description="Hub dataset configuration.")
    split: str | None = Field(
        default=None, description="Split to sample from; a shortcut's default when empty."
    )
    text_column: str | None = Field(
        default=None, description="Column holding the text or chat messages."
    )
    dataset_loader: str | None = Field(
        default=None,
        pattern=IMPORT_PATH_PATTERN,
        description="`module:function` returning a datasets.Dataset, called with DatasetArgs.",
    )
    samples: int = Field(default=32, gt=0, description="Number of held-out texts scored.")
    max_seq_len: int = Field(default=512, gt=1, description="Maximum tokens per text.")
    seed: int = Field(
        default=1234, description="Seed for sampling held-out rows (calibration's default is 42)."
    )

    def dataset_args(self) -> DatasetArgs:
        fields = self.model_dump(exclude={"samples"})
        return DatasetArgs(**fields, text_samples=self.samples)


class QualityGate(_Args):
    max_perplexity_increase_pct: float | None = Field(
        default=10.0,
        ge=0,
        description="Largest allowed perplexity increase over the base model, in percent "
        "(empty: no limit).",
    )
    max_kl: float | None = Field(
        default=0.1,
        ge=0,
        description="Largest allowed mean KL(base || compressed) per token, in nats "
        "(empty: no limit).",
    )
    on_threshold: Literal["fail", "flag"] = Field(
        default="fail",
        description="fail: the run fails when a limit is passed. flag: it completes, with "
        "passed=false in its result, a warning and the artifact marking the breach.",
    )


class LmEvalArgs(_Args):
    tasks: list[str] = Field(
        default_factory=list,
        description="lm-eval-harness task names (e.g. hellaswag) run on both models; needs "
        "lm-eval installed on the worker and the tasks' datasets reachable.",
    )
    limit: int | None = Field(
        default=None, gt=0, description="Examples per lm-eval task (empty: all of them)."
    )


def metric_rows(report: EvaluationReport, gate: QualityGate) -> list[dict]:
    """The table shown in Prefect and ClearML: one row per metric, base beside compressed."""
    m = report.metrics
    rows = [
        {"metric": "perplexity", "base": m.base_perplexity, "compressed": m.compressed_perplexity,
         "change": f"{m.perplexity_increase_pct:+.2f}%", "limit": gate.max_perplexity_increase_pct},
        {"metric": "KL(base || compressed), nats/token", "base": 0.0,
         "compressed": m.kl_divergence, "change": "", "limit": gate.max_kl},
        {"metric": "top-1 agreement", "base": 1.0, "compressed": m.top1_agreement,
         "change": "", "limit": None},
    ]  # fmt: skip
    for name, value in report.lm_eval.get("compressed", {}).items():
        base = report.lm_eval.get("base", {}).get(name)
        rows.append({"metric": f"lm-eval {name}", "base": base, "compressed": value,
                     "change": "", "limit": None})  # fmt: skip
    return rows


@flow(name="evaluate-model", persist_result=True)
def evaluate(
    compressed: ModelArgs,
    base: ModelArgs | None = None,
    held_out: HeldOutArgs = HeldOutArgs(),
    gate: QualityGate = QualityGate(),
    lm_eval: LmEvalArgs = LmEvalArgs(),
    tracking: TrackingArgs = TrackingArgs(),
) -> EvaluationReport:
    """Score `compressed` against `base` on held-out text and apply the quality gate.

    `base` defaults to the model recorded in the compressed model's manifest.
    """
    log = get_run_logger()
    check_lm_eval(lm_eval.tasks)
    compressed_path = resolve_compressed(compressed)
    manifest = published_manifest(str(compressed_path))
    base = base or base_model_args(manifest)
    if base is None:
        raise InputError(
            "base",
            f"{compressed.model_id} has no compressflow manifest naming its base model",
            "pass base.model_id (the model it was compressed from)",
        )
    scheme = manifest.get("result", {}).get("scheme")
    inputs = {
        "compressed": compressed.model_dump(),
        "base": base.model_dump(),
        "held_out": held_out.model_dump(),
        "gate": gate.model_dump(),
        "lm_eval": lm_eval.model_dump(),
    }
    with track_flow_run(
        tracking, f"evaluate {compressed_path.name}", ["evaluation", scheme or "custom"], inputs
    ) as tracker:
        fetched = fetch_model(base)
        text = build_held_out(held_out.dataset_args(), fetched, calibration_args(manifest))
        metrics = compare_models(fetched, str(compressed_path), text)
        scores = {
            name: run_lm_eval(path, lm_eval.tasks, lm_eval.limit, base.trust_remote_code)
            for name, path in (("base", fetched.path), ("compressed", str(compressed_path)))
            if lm_eval.tasks
        }
        found = breaches(metrics, gate.max_perplexity_increase_pct, gate.max_kl)
        report = EvaluationReport(
            compressed_path=str(compressed_path),
            base_identity=fetched.identity,
            scheme=scheme,
            held_out_source=text.source,
            excluded_calibration_samples=text.excluded_calibration_samples,
            metrics=metrics,
            lm_eval=scores,
            breaches=found,
            passed=not found,
        )
        rows = metric_rows(report, gate)
        tracker.scalar("perplexity", "base", metrics.base_perplexity)
        tracker.scalar("perplexity", "compressed", metrics.compressed_perplexity)
        for name in ("perplexity_increase_pct", "kl_divergence", "top1_agreement"):
            tracker.single(name, getattr(metrics, name))
        for model, values in scores.items():
            for name, value in values.items():
                tracker.scalar(f"lm-eval {name}", model, value)
        tracker.table("evaluation", rows)
        verdict = "within limits" if report.passed else "OVER LIMITS: " + "; ".join(found)
        tracker.text(f"Quality gate ({gate.on_threshold}): {verdict}")
        create_table_artifact(
            rows,
            key="evaluation-metrics",
            description=f"{Path(report.compressed_path).name} against {report.base_identity}: "
            f"{verdict}",
        )
    report.tracking = tracker.status()
    if found:
        message = f"{compressed_path} lost too much quality: {'; '.join(found)}"
        if gate.on_threshold == "fail":
            raise QualityThresholdExceeded(message)
        log.warning("Flagged: %s", message)
    return report
