"""An evaluate-model report with fixed figures, for the tests of what reads or records one."""

from __future__ import annotations

from compressflow.results import EvaluationReport, QualityMetrics


def evaluation_report(compressed_path: str = "/out/m", **lm_eval) -> EvaluationReport:
    return EvaluationReport(
        compressed_path=compressed_path,
        base_identity="sha256:x",
        scheme="W4A16",
        held_out_source="shortcut:python_docs",
        excluded_calibration_samples=0,
        metrics=QualityMetrics(
            samples=8,
            tokens=100,
            base_perplexity=12.345678,
            compressed_perplexity=13.456789,
            perplexity_increase_pct=9.00123,
            kl_divergence=0.0123456789,
            top1_agreement=0.9345678,
        ),
        lm_eval=lm_eval,
        breaches=[],
        passed=True,
    )
