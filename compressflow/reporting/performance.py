"""What serving the compressed model buys, shown where people look: the card's "Performance"
section, rows of the evaluation's table artifact, a chart artifact read at a glance, and ClearML
scalars and a plot, all made from one `ServedPerformance`.

Every figure is a median over the repeats with its spread (lowest to highest); a difference
inside the spread reads "no measurable difference", never a speed-up. The device, vLLM's backend
and the kernel each model ran name the hardware the figures hold for.

The chart is plain SVG text like the trade-off chart (`tradeoff.py`), shown inline in the Prefect
artifact (a data URI). The card has the table only: a chart file beside it would be a file the
folder's manifest does not list, and the folder would no longer be reused.
"""

from __future__ import annotations

from html import escape
from typing import Any

from compressflow.evaluation.result import (
    SERVED_METRICS,
    ServedFigure,
    ServedLevel,
    ServedPerformance,
)
from compressflow.reporting.tradeoff import data_uri

# How each metric reads for a person.
LABELS = {
    "output_throughput": "output throughput",
    "ttft_p50": "time to first token p50",
    "ttft_p95": "time to first token p95",
    "itl_p50": "inter-token latency p50",
    "itl_p95": "inter-token latency p95",
}
# The table's: short enough that Prefect's artifact view shows every column.
SHORT = {
    "output_throughput": "throughput",
    "ttft_p50": "TTFT p50",
    "ttft_p95": "TTFT p95",
    "itl_p50": "ITL p50",
    "itl_p95": "ITL p95",
}
# The chart's panels: throughput (the gate's measure) and the two latencies a user feels.
CHART_METRICS = ("output_throughput", "ttft_p50", "itl_p50")
MODELS = ("base", "compressed")
COLOURS = {"base": "#9e9e9e", "compressed": "#1f77b4"}


def unit(metric: str) -> str:
    return SERVED_METRICS[metric][1]


def higher_is_better(metric: str) -> bool:
    return SERVED_METRICS[metric][2]


def number(value: float) -> str:
    """Three significant figures, plain: 1234.5 -> 1230, 12.345 -> 12.3, 0.01234 -> 0.0123."""
    return f"{float(f'{value:.3g}'):g}"


def figure_text(figure: ServedFigure | None) -> str:
    """`median (low to high)`; one repeat has no spread to show."""
    if figure is None:
        return "—"
    if figure.low == figure.high:
        return number(figure.median)
    return f"{number(figure.median)} ({number(figure.low)} to {number(figure.high)})"


def reading(level: ServedLevel, metric: str) -> str:
    """'faster' / 'slower' / 'no measurable difference' for one metric at one level: the
    measurement's own verdict for throughput, the same rule (spreads overlap: no difference)
    for the latencies."""
    if metric == "output_throughput":
        return level.verdict
    base, compressed = level.base.get(metric), level.compressed.get(metric)
    if base is None or compressed is None:
        return ""
    if compressed.low <= base.high and base.low <= compressed.high:
        return "no measurable difference"
    better = (
        compressed.median > base.median
        if higher_is_better(metric)
        else (compressed.median < base.median)
    )
    return "faster" if better else "slower"


def ratio(level: ServedLevel, metric: str) -> float | None:
    """Compressed over base, medians (throughput: the measurement's own ratio)."""
    if metric == "output_throughput":
        return level.throughput_ratio
    base, compressed = level.base.get(metric), level.compressed.get(metric)
    if base is None or compressed is None or not base.median:
        return None
    return compressed.median / base.median


def ratio_text(level: ServedLevel, metric: str) -> str:
    found = ratio(level, metric)
    return "" if found is None else f"{found:.2f}x"


def not_measured(served: ServedPerformance) -> str:
    """The line shown instead of figures, with vLLM's or the environment's reason."""
    what = "not measured here" if served.status == "not measured here" else "measurement failed"
    return f"{what}: {served.reason}" if served.reason else what


def hardware_line(served: ServedPerformance) -> str:
    kernels = ", ".join(
        f"{model}: {served.kernels[model]}" for model in MODELS if model in served.kernels
    )
    return f"{served.backend or 'vLLM'} on {served.device or 'an unnamed device'}" + (
        f"; kernels {kernels}" if kernels else ""
    )


def workload_line(workload: dict[str, Any]) -> str:
    """The workload as a sentence: what a reader needs to compare it with their own."""
    if not workload:
        return ""
    levels = workload.get("concurrency", [])
    return (
        f"{workload.get('prompts')} prompts of {workload.get('input_len')} tokens cut from the "
        f"held-out texts (seed {workload.get('seed')}), {workload.get('output_len')} tokens "
        f"generated each, at concurrency {', '.join(map(str, levels))}; "
        f"{workload.get('repeats')} repeats per model and level, interleaved base / compressed"
    )


def memory_lines(served: ServedPerformance) -> list[str]:
    lines = []
    weights = served.weights_memory_gib
    if weights:
        parts = [f"{model} {weights[model]:.3g} GiB" for model in MODELS if model in weights]
        if weights.get("base") and "compressed" in weights:
            parts.append(f"{weights['compressed'] / weights['base']:.2f}x")
        source = served.weights_memory_source or "vLLM's report"
        lines.append(f"- **Weights memory** ({source}): {', '.join(parts)}")
    tokens = served.kv_cache_tokens
    if tokens:
        parts = [f"{model} {tokens[model]:,}" for model in MODELS if model in tokens]
        lines.append(f"- **KV-cache tokens on the GPU** (vLLM's report): {', '.join(parts)}")
    elif "CPU" in served.backend:
        lines.append(
            "- **KV-cache capacity**: set by a setting on vLLM-CPU (VLLM_CPU_KVCACHE_SPACE), so "
            "not a result here"
        )
    return lines


def figures_table(served: ServedPerformance) -> str:
    rows = [
        f"| {level.concurrency} | {SHORT[metric]} ({unit(metric)}) | "
        f"{figure_text(level.base.get(metric))} | {figure_text(level.compressed.get(metric))} | "
        f"{ratio_text(level, metric)} | {reading(level, metric)} |"
        for level in sorted(served.levels, key=lambda level: level.concurrency)
        for metric in SERVED_METRICS
    ]
    return (
        "| concurrency | metric | base | compressed | ratio | reads |\n"
        "|---|---|---|---|---|---|\n" + "\n".join(rows)
    )


def performance_markdown(
    served: ServedPerformance, heading: str = "##", chart: bool = False
) -> str:
    """The card's "Performance" section (`heading` its level); with `chart`, the chart inline
    above the table (the Prefect artifact)."""
    if served.status != "measured":
        lines = [f"{heading} Performance", "", f"Served speed and memory: {not_measured(served)}."]
        if served.workload:
            lines += ["", f"- **Workload asked for**: {workload_line(served.workload)}"]
        return "\n".join(lines) + "\n"
    lines = [
        f"{heading} Performance",
        "",
        f"The base and the compressed model, each served by {hardware_line(served)}, with the "
        "same flags, measured by vLLM's own benchmark (`vllm bench serve`). Each figure is the "
        "median over the repeats, with the lowest and highest in brackets; where those spreads "
        "overlap the row reads no measurable difference. Ratio: compressed over base (TTFT: time "
        "to first token; ITL: inter-token latency).",
        "",
    ]
    if chart and served.levels:
        lines += [f"![served performance]({data_uri(performance_svg(served))})", ""]
    lines += [figures_table(served), "", *memory_lines(served)]
    if served.workload:
        lines.append(f"- **Workload**: {workload_line(served.workload)}")
    if served.serve_flags:
        lines.append(f"- **Served with**: `vllm serve <model> {' '.join(served.serve_flags)}`")
    lines.append(f"- **Took**: {served.seconds:.0f} s for both models")
    return "\n".join(lines) + "\n"


def headline(served: ServedPerformance) -> str:
    """One line a person reads first: the ratio at the highest concurrency, honestly worded."""
    if served.status != "measured" or not served.levels:
        return f"Served performance {not_measured(served)}"
    top = served.highest_level()
    verdict = (
        "no measurable difference"
        if top.verdict == "no measurable difference"
        else f"{top.verdict} than the base"
    )
    return (
        f"Compressed serves {top.throughput_ratio:.2f}x the base's output throughput at "
        f"concurrency {top.concurrency}: {verdict}"
    )


# ---------------------------------------------------------------- rows of the evaluation table


def performance_rows(served: ServedPerformance | None, min_speedup: float) -> list[dict]:
    """The evaluation table's rows (metric, base, compressed, change, limit), beside quality's."""
    if served is None:
        return []
    if served.status != "measured":
        return [
            {
                "metric": "served performance (vLLM)",
                "base": "",
                "compressed": not_measured(served),
                "change": "",
                "limit": f"min speedup: {min_speedup:g}x (flag only)" if min_speedup else "",
            }
        ]
    top = served.highest_level().concurrency if served.levels else None
    rows = []
    for level in sorted(served.levels, key=lambda level: level.concurrency):
        for metric in SERVED_METRICS:
            gated = metric == "output_throughput" and level.concurrency == top and min_speedup
            shown = ratio_text(level, metric)
            rows.append(
                {
                    "metric": f"served {LABELS[metric]} at concurrency {level.concurrency}, "
                    f"{unit(metric)}",
                    "base": figure_text(level.base.get(metric)),
                    "compressed": figure_text(level.compressed.get(metric)),
                    "change": f"{shown} ({reading(level, metric)})" if shown else "",
                    "limit": f"min speedup: {min_speedup:g}x" if gated else "",
                }
            )
    for model_figures, label in (
        (served.weights_memory_gib, "weights memory, GiB"),
        (served.kv_cache_tokens, "KV-cache tokens on the GPU"),
    ):
        if model_figures:
            rows.append(
                {
                    "metric": f"served {label}",
                    "base": model_figures.get("base", "—"),
                    "compressed": model_figures.get("compressed", "—"),
                    "change": "",
                    "limit": "",
                }
            )
    rows.append(
        {
            "metric": "served on",
            "base": served.kernels.get("base", ""),
            "compressed": served.kernels.get("compressed", ""),
            "change": "",
            "limit": f"{served.backend}, {served.device}",
        }
    )
    return rows


# ---------------------------------------------------------------- the chart

PANEL_WIDTH, PANEL_HEIGHT, TOP, BOTTOM, LEFT = 300, 270, 74, 44, 52


def _panel(served: ServedPerformance, metric: str, left: float) -> list[str]:
    """One metric: a pair of bars per concurrency level (median), a whisker for the spread,
    the ratio above each pair."""
    levels = sorted(served.levels, key=lambda level: level.concurrency)
    figures = [
        figure
        for level in levels
        for model in MODELS
        if (figure := getattr(level, model).get(metric)) is not None
    ]
    if not figures:
        return []
    top_value = max(figure.high for figure in figures) * 1.15 or 1.0
    plot_h = PANEL_HEIGHT - TOP - BOTTOM
    base_y = TOP + plot_h

    def y(value: float) -> float:
        return base_y - value / top_value * plot_h

    better = "higher is better" if higher_is_better(metric) else "lower is better"
    parts = [
        f'<text x="{left + PANEL_WIDTH / 2}" y="{TOP - 30}" text-anchor="middle" '
        f'font-weight="bold">{escape(LABELS[metric])}</text>',
        f'<text x="{left + PANEL_WIDTH / 2}" y="{TOP - 16}" text-anchor="middle" fill="#555">'
        f"{escape(unit(metric))}, {better}</text>",
        f'<line x1="{left + LEFT}" y1="{base_y}" x2="{left + PANEL_WIDTH - 8}" y2="{base_y}" '
        'stroke="#333"/>',
        f'<text x="{left + LEFT - 4}" y="{y(top_value / 1.15) + 4:.1f}" text-anchor="end">'
        f"{number(top_value / 1.15)}</text>",
        f'<text x="{left + LEFT - 4}" y="{base_y + 4}" text-anchor="end">0</text>',
    ]
    slot = (PANEL_WIDTH - LEFT - 8) / len(levels)
    bar = min(slot / 3, 36)
    for index, level in enumerate(levels):
        middle = left + LEFT + slot * (index + 0.5)
        for offset, model in ((-1, "base"), (0, "compressed")):
            figure = getattr(level, model).get(metric)
            if figure is None:
                continue
            x = middle + offset * bar
            parts.append(
                f'<rect x="{x:.1f}" y="{y(figure.median):.1f}" width="{bar:.1f}" '
                f'height="{base_y - y(figure.median):.1f}" fill="{COLOURS[model]}">'
                f"<title>{model}: {figure_text(figure)} {escape(unit(metric))}</title></rect>"
                f'<line x1="{x + bar / 2:.1f}" y1="{y(figure.low):.1f}" x2="{x + bar / 2:.1f}" '
                f'y2="{y(figure.high):.1f}" stroke="#222" stroke-width="1.5"/>'
            )
        verdict = reading(level, metric)
        label = "≈ same" if verdict == "no measurable difference" else ratio_text(level, metric)
        colour = {"faster": "#2e7d32", "slower": "#c62828"}.get(verdict, "#555")
        tallest = max(
            (f.high for m in MODELS if (f := getattr(level, m).get(metric)) is not None),
            default=0.0,
        )
        parts += [
            f'<text x="{middle:.1f}" y="{y(tallest) - 6:.1f}" text-anchor="middle" '
            f'fill="{colour}" font-weight="bold">{escape(label)}</text>',
            f'<text x="{middle:.1f}" y="{base_y + 16}" text-anchor="middle">{level.concurrency}'
            "</text>",
        ]
    parts.append(
        f'<text x="{left + LEFT + (PANEL_WIDTH - LEFT) / 2}" y="{base_y + 32}" '
        'text-anchor="middle" fill="#555">requests in flight</text>'
    )
    return parts


def performance_svg(served: ServedPerformance) -> str:
    """Base (grey) beside compressed (blue) per concurrency level, a panel per metric; whiskers
    span the repeats; above each pair, compressed over base, or "≈ same" inside the spread."""
    metrics = [m for m in CHART_METRICS if any(m in level.base for level in served.levels)]
    width = PANEL_WIDTH * max(len(metrics), 1) + 16
    height = PANEL_HEIGHT + 44
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="12" y="18" font-size="13" font-weight="bold">{escape(headline(served))}</text>',
        f'<text x="12" y="{height - 10}" fill="#555">{escape(hardware_line(served))}. Bars: '
        "medians; whiskers: lowest to highest repeat.</text>",
        f'<rect x="{width - 150}" y="26" width="10" height="10" fill="{COLOURS["base"]}"/>'
        f'<text x="{width - 136}" y="35">base</text>'
        f'<rect x="{width - 96}" y="26" width="10" height="10" fill="{COLOURS["compressed"]}"/>'
        f'<text x="{width - 82}" y="35">compressed</text>',
    ]
    for index, metric in enumerate(metrics):
        parts += _panel(served, metric, 8 + index * PANEL_WIDTH)
    parts.append("</svg>")
    return "".join(parts)


# ---------------------------------------------------------------- ClearML


def log_performance(tracker, served: ServedPerformance | None) -> None:
    """Scalars per metric with the concurrency as the iteration (ClearML draws each metric's
    base and compressed series against the requests in flight), the throughput ratio, the
    weights memory, and a bar plot of throughput per level; a not-measured run logs its reason."""
    if served is None:
        return
    if served.status != "measured":
        tracker.text(f"Served performance {not_measured(served)}")
        return
    for level in served.levels:
        for metric in SERVED_METRICS:
            for model in MODELS:
                figure = getattr(level, model).get(metric)
                if figure is not None:
                    tracker.scalar(
                        f"served {LABELS[metric]} ({unit(metric)})",
                        model,
                        figure.median,
                        iteration=level.concurrency,
                    )
        tracker.scalar(
            "served throughput, compressed / base",
            "ratio",
            level.throughput_ratio,
            iteration=level.concurrency,
        )
    for model, gib in served.weights_memory_gib.items():
        tracker.single(f"served weights memory GiB ({model})", gib)
    for model, tokens in served.kv_cache_tokens.items():
        tracker.single(f"served KV-cache tokens ({model})", tokens)
    levels = sorted(served.levels, key=lambda level: level.concurrency)
    for model in MODELS:
        measured = [
            (level.concurrency, figure.median)
            for level in levels
            if (figure := getattr(level, model).get("output_throughput")) is not None
        ]
        tracker.bars(
            "served output throughput (tokens/s)",
            model,
            [median for _, median in measured],
            [f"concurrency {concurrency}" for concurrency, _ in measured],
            ("concurrency", "tokens/s"),
        )
    tracker.text(f"{headline(served)} ({hardware_line(served)})")


# ---------------------------------------------------------------- Prefect


def publish_performance(served: ServedPerformance, key: str, against: str) -> None:
    """The chart and the table on the evaluation's Prefect run, as one markdown artifact; a
    model not measured here gets the artifact too, saying why."""
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(
        key=key,
        markdown=performance_markdown(served, heading="#", chart=True),
        description=f"{headline(served)} ({against})",
    )
