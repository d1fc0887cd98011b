"""Served performance as a person sees it and as the gate judges it, from a constructed
ServedPerformance (tests/support/reports.py, in the shape of a recorded measurement): the gate's
breach and its flags, the card's Performance section, the evaluation table's rows, the chart,
and the ClearML calls."""

from __future__ import annotations

from pathlib import Path
from xml.etree import ElementTree

import pytest
from support.reports import evaluation_report, served_figure, served_level, served_performance

from compressflow.errors import QualityThresholdExceeded
from compressflow.evaluation.served_gate import SPEED_BREACH, judge_speed
from compressflow.flows.evaluate import apply_gate
from compressflow.params import QualityGate
from compressflow.reporting.evaluation import metric_rows
from compressflow.reporting.model_card import evaluation_section
from compressflow.reporting.performance import (
    log_performance,
    performance_markdown,
    performance_rows,
    performance_svg,
)
from compressflow.reporting.tracking import Tracker
from compressflow.results import ServedPerformance

NOT_HERE = ServedPerformance(
    status="not measured here", reason="no vLLM environment (COMPRESSFLOW_VLLM_PYTHON is off)"
)


def slower(verdict: str = "slower", spread: float = 1.0):
    """The compressed model at half the base's throughput at concurrency 4 (1 is faster)."""
    return served_performance(
        levels=[
            served_level(1, (40.0, 39.0, 41.0), (50.0, 49.0, 51.0), "faster"),
            served_level(
                4, (80.0, 80.0 - spread, 80.0 + spread), (40.0, 40 - spread, 40 + spread), verdict
            ),
        ]
    )


# ---------------------------------------------------------------- the gate


def test_no_limit_judges_nothing():
    assert judge_speed(slower(), 0) == judge_speed(None, 0) == judge_speed(NOT_HERE, 0)
    assert not judge_speed(slower(), 0).breaches and not judge_speed(NOT_HERE, 0).flags


def test_a_clearly_slower_model_breaches_the_limit_at_the_highest_concurrency():
    # Faster at concurrency 1, half as fast at 4: the highest level decides.
    judged = judge_speed(slower(), 0.9)
    assert judged.flags == []
    assert judged.breaches == [
        f"{SPEED_BREACH} 0.50x the base's at concurrency 4 (at most 0.52x within the repeats' "
        "spread; limit 0.9x)"
    ]


def test_a_model_as_fast_as_asked_passes():
    assert judge_speed(served_performance(), 1.0) == judge_speed(slower(), 0.5)
    assert not judge_speed(slower(), 0.5).breaches and not judge_speed(slower(), 0.5).flags


@pytest.mark.parametrize(
    ("served", "words"),
    [
        (None, "served.measure is off"),
        (NOT_HERE, "not measured here: no vLLM environment"),
        (ServedPerformance(status="failed", reason="vLLM exited"), "measurement failed: vLLM"),
        (ServedPerformance(status="measured"), "holds no concurrency level"),
        # The recorded figures: 1.03x at concurrency 4, inside the spread.
        (served_performance(), "no measurable difference at concurrency 4 (1.03x"),
        # 0.5x by the medians, but the spreads reach 1.4x: not clearly below the limit, 1.2.
        (slower(spread=30.0), "0.50x at concurrency 4 and up to 1.40x within the repeats' spread"),
    ],
)
def test_what_cannot_be_judged_only_flags(served, words):
    judged = judge_speed(served, 1.2 if served is not None and served.levels else 0.9)
    assert judged.breaches == [] and len(judged.flags) == 1
    assert judged.flags[0].startswith("gate.min_speedup") and words in judged.flags[0]


def test_a_speed_up_inside_the_spread_does_not_pass_a_limit_above_one():
    # Recorded: 1.03x at concurrency 4, the spreads overlapping; a limit of 1.01 is not shown met.
    judged = judge_speed(served_performance(), 1.01)
    assert judged.breaches == [] and len(judged.flags) == 1
    assert "no measurable difference at concurrency 4 (1.03x" in judged.flags[0]


def test_a_speed_breach_fails_with_the_speed_fix_or_only_flags():
    found = judge_speed(slower(), 0.9).breaches
    with pytest.raises(QualityThresholdExceeded) as raised:
        apply_gate(found, Path("/out/m"), QualityGate(min_speedup=0.9))
    error = raised.value
    assert error.field == "gate" and "serves slower than allowed" in error.problem
    assert "lower gate.min_speedup" in error.fix and "gate.on_threshold" in error.fix
    assert "gentler recipe" not in error.fix  # no quality limit was passed
    apply_gate(found, Path("/out/m"), QualityGate(min_speedup=0.9, on_threshold="flag"))


# ---------------------------------------------------------------- the card


def test_the_card_shows_medians_spreads_ratios_hardware_and_the_serve_flags():
    report = evaluation_report()
    report.served = served_performance()
    section = evaluation_section(report, "acme/base", "transformers")
    performance = section[section.index("## Performance") :]
    assert "vLLM 0.32.0 (CPU) on AMD EPYC 7B13 (2 cores, AVX2)" in performance
    assert "compressed: oneDNN int8 (W8A8)" in performance
    assert (
        "| 1 | throughput (tokens/s) | 41.2 (40.1 to 42) | 55.3 (54 to 57.1) | 1.34x | "
        "faster |" in performance
    )
    assert (
        "| 4 | throughput (tokens/s) | 88 (80.5 to 93.1) | 90.2 (86 to 97.4) | 1.03x | "
        "no measurable difference |" in performance
    )
    assert "| 1 | TTFT p50 (ms) |" in performance
    assert "base 0.2 GiB, compressed 0.11 GiB, 0.55x" in performance
    assert "VLLM_CPU_KVCACHE_SPACE" in performance  # vLLM-CPU: its KV cache is a setting
    assert (
        "`vllm serve <model> --dtype bfloat16 --max-model-len 256 --enforce-eager`" in performance
    )
    assert "16 prompts of 128 tokens" in performance and "concurrency 1, 4" in performance
    assert "3 repeats per model and level, interleaved" in performance
    assert section.endswith("<!-- compressflow: end of evaluation -->\n")


def test_the_card_says_not_measured_here_and_why():
    report = evaluation_report()
    report.served, report.flags = NOT_HERE, ["gate.min_speedup 1.2 not judged: ..."]
    section = evaluation_section(report, "acme/base", "transformers")
    assert (
        "## Performance\n\nServed speed and memory: not measured here: no vLLM environment "
        "(COMPRESSFLOW_VLLM_PYTHON is off)." in section
    )
    assert "(flagged: gate.min_speedup 1.2 not judged: ...)" in section
    assert "## Performance" not in evaluation_section(evaluation_report(), "a", "transformers")


def test_a_gpu_measurement_shows_the_kv_cache_tokens():
    served = served_performance(backend="vLLM 0.32.0 (CUDA)", kv_cache_tokens={"base": 120000})
    text = performance_markdown(
        served.model_copy(update={"kv_cache_tokens": {"base": 120000, "compressed": 310000}})
    )
    assert (
        "- **KV-cache tokens on the GPU** (vLLM's report): base 120,000, compressed 310,000" in text
    )
    assert "VLLM_CPU_KVCACHE_SPACE" not in text


# ---------------------------------------------------------------- the table artifact


def test_the_evaluation_table_gains_a_row_per_level_and_metric_and_the_limit():
    report = evaluation_report()
    report.served = served_performance()
    rows = {r["metric"]: r for r in metric_rows(report, QualityGate(min_speedup=1.2))}
    top = rows["served output throughput at concurrency 4, tokens/s"]
    assert (top["base"], top["compressed"]) == ("88 (80.5 to 93.1)", "90.2 (86 to 97.4)")
    assert top["change"] == "1.03x (no measurable difference)"
    assert top["limit"] == "min speedup: 1.2x"
    assert rows["served output throughput at concurrency 1, tokens/s"]["limit"] == ""
    assert rows["served inter-token latency p95 at concurrency 1, ms"]["change"].endswith(
        "(faster)"
    )
    assert rows["served weights memory, GiB"]["compressed"] == 0.11
    assert rows["served on"]["compressed"] == "oneDNN int8 (W8A8)"
    assert len([r for r in rows if r.startswith("served ") and "concurrency" in r]) == 10


def test_the_table_marks_what_the_gate_could_not_judge():
    report = evaluation_report()
    report.served = NOT_HERE
    report.flags = judge_speed(NOT_HERE, 1.2).flags
    rows = metric_rows(report, QualityGate(min_speedup=1.2))
    assert rows[-2]["compressed"].startswith("not measured here: no vLLM environment")
    assert rows[-2]["limit"] == "min speedup: 1.2x (flag only)"
    assert rows[-1]["metric"] == "gate: not judged (a warning)"
    assert rows[-1]["limit"].startswith("gate.min_speedup 1.2 not judged")
    assert performance_rows(None, 1.2) == []


# ---------------------------------------------------------------- the chart


def test_the_chart_shows_both_models_per_level_with_spreads_and_the_verdicts():
    served = served_performance()
    svg = performance_svg(served)
    tree = ElementTree.fromstring(svg)
    texts = [t.text for t in tree.iter("{http://www.w3.org/2000/svg}text")]
    bars = [r for r in tree.iter("{http://www.w3.org/2000/svg}rect") if r.find("*") is not None]
    assert len(bars) == 3 * 2 * 2  # 3 panels x 2 levels x base and compressed
    assert texts[0] == (
        "Compressed serves 1.03x the base's output throughput at concurrency 4: no measurable "
        "difference"
    )
    assert "1.34x" in texts and "≈ same" in texts  # concurrency 1 faster, 4 inside the spread
    assert {"output throughput", "time to first token p50", "inter-token latency p50"} <= set(texts)
    markdown = performance_markdown(served, heading="#", chart=True)
    assert markdown.startswith("# Performance") and "](data:image/svg+xml;base64," in markdown


def test_one_repeat_shows_no_spread():
    assert served_figure(41.0).median == 41.0
    level = served_level(1, (41.0,), (55.0,), "faster")
    assert "| 41 | 55 | 1.34x | faster |" in performance_markdown(
        served_performance(levels=[level])
    )


# ---------------------------------------------------------------- ClearML


class Recorded:
    """A ClearML task and logger that records what it is asked to report."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

    def get_logger(self):
        return self

    def __getattr__(self, method):
        return lambda *args, **kwargs: self.calls.append((method, {"args": args, **kwargs}))


def test_clearml_gets_scalars_per_level_and_metric_and_a_bar_plot():
    task = Recorded()
    log_performance(Tracker(task=task, mode="offline"), served_performance())
    scalars = {
        (c["title"], c["series"], c["iteration"]): c["value"]
        for method, c in task.calls
        if method == "report_scalar"
    }
    assert scalars[("served output throughput (tokens/s)", "base", 4)] == 88.0
    assert scalars[("served output throughput (tokens/s)", "compressed", 1)] == 55.3
    assert ("served inter-token latency p95 (ms)", "compressed", 4) in scalars
    assert scalars[("served throughput, compressed / base", "ratio", 1)] == pytest.approx(
        55.3 / 41.2
    )
    assert len(scalars) == 2 * (5 * 2 + 1)
    bars = [c for method, c in task.calls if method == "report_histogram"]
    assert [b["series"] for b in bars] == ["base", "compressed"]
    assert bars[1]["values"] == [55.3, 90.2]
    assert bars[1]["xlabels"] == ["concurrency 1", "concurrency 4"]
    singles = [c["args"] for method, c in task.calls if method == "report_single_value"]
    assert ("served weights memory GiB (compressed)", 0.11) in singles


def test_clearml_gets_the_reason_when_not_measured():
    task = Recorded()
    log_performance(Tracker(task=task, mode="offline"), NOT_HERE)
    assert task.calls == [
        ("report_text", {"args": (f"Served performance not measured here: {NOT_HERE.reason}",)})
    ]


# ---------------------------------------------------------------- the parameters


def test_a_level_twice_or_fewer_prompts_than_a_level_is_refused_with_the_fix():
    from pydantic import ValidationError

    from compressflow.params import ServedArgs

    with pytest.raises(ValidationError) as twice:
        ServedArgs(concurrency=[4, 1, 4])
    assert str(twice.value.errors()[0]["ctx"]["error"]) == (
        "served.concurrency: [4, 1, 4] lists the level 4 more than once. Fix: list each level "
        "once, e.g. [1, 4]"
    )
    with pytest.raises(ValidationError) as few:
        ServedArgs(concurrency=[1, 64], prompts=16)
    error = few.value.errors()[0]["ctx"]["error"]
    assert error.field == "served.prompts" and "never put 64 in flight" in error.problem
    assert ServedArgs(concurrency=[64], prompts=64).prompts == 64
