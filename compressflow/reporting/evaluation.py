"""What a person sees of an evaluation: its table (a row per metric, base beside compressed,
served performance's rows after quality's) in Prefect and ClearML, its figures as ClearML
scalars, and the served-performance chart artifact (`performance.py`)."""

from __future__ import annotations

from pathlib import Path

from compressflow.params import QualityGate
from compressflow.reporting.artifacts import (
    artifact_key,
    percent,
    percent_change,
    percent_points,
    perplexity,
    significant,
    significant_text,
)
from compressflow.reporting.performance import (
    log_performance,
    performance_rows,
    publish_performance,
)
from compressflow.results import EvaluationReport


def metric_rows(report: EvaluationReport, gate: QualityGate) -> list[dict]:
    """The table shown in Prefect and ClearML: one row per metric, base beside compressed."""
    m = report.metrics
    ppl_limit, kl_limit = gate.max_perplexity_increase_pct, gate.max_kl  # 0: no limit
    rows = [
        {
            "metric": "perplexity",
            "base": perplexity(m.base_perplexity),
            "compressed": perplexity(m.compressed_perplexity),
            "change": percent_change(m.perplexity_increase_pct),
            "limit": "none" if not ppl_limit else f"max increase: {percent_points(ppl_limit)}",
        },
        {
            "metric": "KL(base || compressed), nats/token",
            "base": 0.0,
            "compressed": "not measured by vLLM"
            if m.kl_divergence is None
            else significant(m.kl_divergence),
            "change": "",
            "limit": "none" if not kl_limit else f"max: {significant_text(kl_limit)} nats/token",
        },
        {
            "metric": "top-1 agreement",
            "base": percent(1.0),
            "compressed": percent(m.top1_agreement),
            "change": "",
            "limit": "",
        },
    ]
    least = gate.min_lm_eval_recovery_pct
    for name, value in report.lm_eval.get("compressed", {}).items():
        recovered = report.lm_eval_recovery.get(name)
        rows.append(
            {
                "metric": f"lm-eval {name} ({report.lm_eval_backend})",
                "base": significant(report.lm_eval.get("base", {}).get(name)),
                "compressed": significant(value),
                "change": "" if recovered is None else f"recovery {recovered:.1f}%",
                "limit": f"min recovery: {least:g}%" if least else "",
            }
        )
    rows += performance_rows(report.served, gate.min_speedup)
    rows += [
        {
            "metric": "gate: not judged (a warning)",
            "base": "",
            "compressed": "",
            "change": "",
            "limit": flag,
        }
        for flag in report.flags
    ]
    return rows


def publish_evaluation(
    tracker, report: EvaluationReport, gate: QualityGate, base_id: str, recipe: str | None
) -> None:
    """The evaluation's figures into ClearML, its table artifact and, where served performance
    was asked for, its chart artifact; both keyed like the compressed model's summary
    (`recipe`: the manifest's recipe source, None: custom)."""
    from prefect.artifacts import create_table_artifact

    m = report.metrics
    rows = metric_rows(report, gate)
    tracker.scalar("perplexity", "base", m.base_perplexity)
    tracker.scalar("perplexity", "compressed", m.compressed_perplexity)
    for name in ("perplexity_increase_pct", "kl_divergence", "top1_agreement"):
        if getattr(m, name) is not None:
            tracker.single(name, getattr(m, name))
    for model, scored in report.lm_eval.items():
        for name, value in scored.items():
            tracker.scalar(f"lm-eval {name}", model, value)
    for name, value in report.lm_eval_recovery.items():
        tracker.scalar("lm-eval recovery %", name, value)
    log_performance(tracker, report.served)
    tracker.table("evaluation", rows)
    verdict = "within limits" if report.passed else "OVER LIMITS: " + "; ".join(report.breaches)
    verdict += "".join(f"; FLAGGED: {flag}" for flag in report.flags)
    tracker.text(f"Quality gate ({gate.on_threshold}): {verdict}")
    against = f"{Path(report.compressed_path).name} against {base_id}"
    create_table_artifact(
        rows, key=artifact_key(base_id, recipe, "evaluation"), description=f"{against}: {verdict}"
    )
    if report.served is not None:
        publish_performance(report.served, artifact_key(base_id, recipe, "performance"), against)
