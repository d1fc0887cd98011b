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

from prefect import flow
from prefect.artifacts import create_table_artifact

from compressflow.blocks.clearml_settings import load_clearml_settings
from compressflow.errors import InputError, QualityThresholdExceeded
from compressflow.logs import run_logger
from compressflow.manifest import read_manifest
from compressflow.params import (
    HeldOutArgs,
    LmEvalArgs,
    ModelArgs,
    QualityGate,
    TrackingArgs,
)
from compressflow.quality import breaches
from compressflow.results import EvaluationReport
from compressflow.tasks.build_held_out import build_held_out
from compressflow.tasks.compare_models import compare_models
from compressflow.tasks.fetch_model import fetch_model, resolve_compressed
from compressflow.tasks.run_lm_eval import check_lm_eval, run_lm_eval
from compressflow.tracking import track_flow_run


def metric_rows(report: EvaluationReport, gate: QualityGate) -> list[dict]:
    """The table shown in Prefect and ClearML: one row per metric, base beside compressed."""
    m = report.metrics
    rows = [
        {
            "metric": "perplexity",
            "base": m.base_perplexity,
            "compressed": m.compressed_perplexity,
            "change": f"{m.perplexity_increase_pct:+.2f}%",
            "limit": gate.max_perplexity_increase_pct,
        },
        {
            "metric": "KL(base || compressed), nats/token",
            "base": 0.0,
            "compressed": m.kl_divergence,
            "change": "",
            "limit": gate.max_kl,
        },
        {
            "metric": "top-1 agreement",
            "base": 1.0,
            "compressed": m.top1_agreement,
            "change": "",
            "limit": None,
        },
    ]
    for name, value in report.lm_eval.get("compressed", {}).items():
        base = report.lm_eval.get("base", {}).get(name)
        rows.append(
            {
                "metric": f"lm-eval {name}",
                "base": base,
                "compressed": value,
                "change": "",
                "limit": None,
            }
        )
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
    log = run_logger(__name__)
    check_lm_eval(lm_eval.tasks)
    compressed_path = resolve_compressed(compressed)
    manifest = read_manifest(compressed_path)
    base = base or (manifest.base_model_args() if manifest else None)
    if base is None:
        raise InputError(
            "base",
            f"{compressed.model_id} has no compressflow manifest naming its base model",
            "pass base.model_id (the model it was compressed from)",
        )
    scheme = manifest.result.scheme if manifest else None
    inputs = {
        "compressed": compressed.model_dump(),
        "base": base.model_dump(),
        "held_out": held_out.model_dump(),
        "gate": gate.model_dump(),
        "lm_eval": lm_eval.model_dump(),
    }
    with track_flow_run(
        tracking,
        load_clearml_settings(tracking.clearml_block),
        f"evaluate {compressed_path.name}",
        ["evaluation", scheme or "custom"],
        inputs,
    ) as tracker:
        fetched = fetch_model(base)
        text = build_held_out(
            held_out.dataset_args(), fetched, manifest.calibration_args() if manifest else None
        )
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
            raise QualityThresholdExceeded(
                "gate",
                message,
                "use a gentler recipe (more calibration samples, a wider scheme) or, if the loss is "
                "acceptable, raise the limits or set quality_gate.on_threshold to flag",
            )
        log.warning("Flagged: %s", message)
    return report
