"""The size vs quality trade-off a mixed-precision budget was chosen from, drawn for a person.

One SVG chart (bits per weight against held-out perplexity: the base model, each uniform
precision and the best mix at other budgets as the sensitivities predict them, and the mixes
calibrated and measured) and one table: the precision chosen for each module, a row per layer.
Plain SVG text, no plotting library: the Prefect artifact shows it inline (a data URI), the model
card beside its README (`tradeoff.svg`), ClearML as a scatter plot of the same points.
"""

from __future__ import annotations

import base64
import math
import re
from html import escape

from compressflow.results import MixPoint, TargetSearch

SVG_FILE = "tradeoff.svg"
WIDTH, HEIGHT, MARGIN = 640, 360, 56
_LAYER = re.compile(r"^(.*?layers?\.\d+)\.(.+)$")


def _scale(values: list[float], low: float, high: float, pad: float = 0.05):
    lo, hi = min(values), max(values)
    span = (hi - lo) or abs(hi) or 1.0
    lo, hi = lo - pad * span, hi + pad * span
    return lambda v: low + (v - lo) / (hi - lo) * (high - low), lo, hi


def tradeoff_svg(points: list[MixPoint], notes: dict[str, str] | None = None) -> str:
    """The chart: x bits per weight, y held-out perplexity; predicted hollow, measured filled,
    with a legend saying so (the SVG travels alone: the card's `tradeoff.svg`). `notes`: words
    beside a point's number, by its label (a benchmark's served speed)."""
    notes = notes or {}
    x, x_lo, x_hi = _scale([p.avg_bits for p in points], MARGIN, WIDTH - 16)
    y, y_lo, y_hi = _scale([p.perplexity for p in points], HEIGHT - MARGIN, 16)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'font-family="sans-serif" font-size="11">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<line x1="{MARGIN}" y1="{HEIGHT - MARGIN}" x2="{WIDTH - 16}" y2="{HEIGHT - MARGIN}" '
        'stroke="#333"/>',
        f'<line x1="{MARGIN}" y1="{HEIGHT - MARGIN}" x2="{MARGIN}" y2="16" stroke="#333"/>',
        f'<text x="{(WIDTH + MARGIN) / 2}" y="{HEIGHT - 14}" text-anchor="middle">'
        "bits per weight (scales included)</text>",
        f'<text x="14" y="{HEIGHT / 2}" text-anchor="middle" '
        f'transform="rotate(-90 14 {HEIGHT / 2})">held-out perplexity</text>',
    ]
    # Whole bits on x (4, 6, 8, ...: the precisions people name), three values on y.
    for bits in range(math.ceil(x_lo / 2) * 2, math.floor(x_hi) + 1, 2):
        parts.append(
            f'<text x="{x(bits):.1f}" y="{HEIGHT - MARGIN + 14}" text-anchor="middle">{bits}</text>'
        )
    for fraction in (0.0, 0.5, 1.0):
        ppl = y_lo + fraction * (y_hi - y_lo)
        parts.append(
            f'<text x="{MARGIN - 4}" y="{y(ppl) + 4:.1f}" text-anchor="end">{ppl:.3f}</text>'
        )
    predicted = sorted((p for p in points if not p.measured), key=lambda p: p.avg_bits)
    if predicted:
        line = " ".join(f"{x(p.avg_bits):.1f},{y(p.perplexity):.1f}" for p in predicted)
        parts.append(f'<polyline points="{line}" fill="none" stroke="#999" stroke-dasharray="4"/>')
    for index, p in enumerate(points):
        fill = "#1f77b4" if p.measured else "white"
        parts.append(
            f'<circle cx="{x(p.avg_bits):.1f}" cy="{y(p.perplexity):.1f}" r="4" fill="{fill}" '
            f'stroke="#1f77b4"><title>{escape(p.label)}: {p.avg_bits:.3f} bits, perplexity '
            f"{p.perplexity:.4f}</title></circle>"
            f'<text x="{x(p.avg_bits) + 6:.1f}" y="{y(p.perplexity) - 6:.1f}" '
            f'fill="#555">{index + 1}{escape(": " + notes[p.label]) if p.label in notes else ""}'
            "</text>"
        )
    parts += [_legend(any(not p.measured for p in points)), "</svg>"]
    return "".join(parts)


def _legend(predicted: bool) -> str:
    """Top right: what a filled and a hollow point mean (hollow only where there are some)."""
    left = WIDTH - 250
    rows = [("#1f77b4", "measured")]
    if predicted:
        rows.append(("white", "predicted (round-to-nearest), not measured"))
    items = [
        f'<circle cx="{left + 6}" cy="{24 + 14 * i}" r="4" fill="{fill}" stroke="#1f77b4"/>'
        f'<text x="{left + 14}" y="{28 + 14 * i}">{text}</text>'
        for i, (fill, text) in enumerate(rows)
    ]
    return '<g class="legend">' + "".join(items) + "</g>"


def points_table(points: list[MixPoint]) -> str:
    rows = [
        f"| {i + 1} | {p.label} | {p.avg_bits:.3f} | {p.perplexity:.4f} | "
        f"{'measured' if p.measured else 'predicted'} |"
        for i, p in enumerate(points)
    ]
    header = (
        "| # | point | bits per weight | perplexity | measured or predicted |\n"
        "|---|---|---|---|---|\n"
    )
    return header + "\n".join(rows)


def precision_map(precisions: dict[str, str]) -> str:
    """A row per layer, a column per module in it, the precision in each cell."""
    rows: dict[str, dict[str, str]] = {}
    for name, precision in precisions.items():
        found = _LAYER.match(name)
        layer, leaf = found.groups() if found else ("", name)
        rows.setdefault(layer, {})[leaf] = precision
    columns = list(dict.fromkeys(leaf for row in rows.values() for leaf in row))
    header = "| layer | " + " | ".join(columns) + " |\n|" + "---|" * (len(columns) + 1) + "\n"
    lines = [
        f"| {layer or '-'} | " + " | ".join(row.get(c, "") for c in columns) + " |"
        for layer, row in rows.items()
    ]
    return header + "\n".join(lines)


def data_uri(svg: str) -> str:
    return "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode()


def tradeoff_markdown(search: TargetSearch, points: list[MixPoint], image: str = "") -> str:
    """The artifact and the card's section: the chart (`image`: where it is; empty: inline),
    its points, and the chosen mix per module."""
    chosen = search.mix
    lines = [
        "### Size against held-out perplexity",
        f"![size vs held-out perplexity]({image or data_uri(tradeoff_svg(points))})",
        "",
        "Hollow points are predicted from the sensitivities (round-to-nearest, which calibration "
        "improves on); filled ones were calibrated and measured.",
        "",
        points_table(points),
    ]
    if chosen is not None:
        lines += [
            "",
            f"### Precision per module ({chosen.avg_bits:.3f} bits per weight)",
            "",
            precision_map(chosen.precisions),
        ]
    return "\n".join(lines) + "\n"
