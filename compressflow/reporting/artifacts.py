"""What the Prefect artifacts a person reads after a run are called, and how their figures read.

Artifact keys name the model and the recipe (`<model>-<recipe>-<kind>`, e.g.
`llama-3-2-1b-instruct-w4a16-summary`): Prefect keeps one latest artifact per key, so a fixed key
would let each model's summary replace the previous model's on the Artifacts page. Figures are
rounded to what a reader can compare, with their unit.
"""

from __future__ import annotations

import hashlib
import math
import re

from compressflow.results import ModuleMetric, StageRecord, Verification

# Prefect allows any length; long keys only make the Artifacts page harder to read.
MAX_KEY_LENGTH = 100
LAYER_ROWS = 50


def slug(text: str, max_length: int = MAX_KEY_LENGTH) -> str:
    """Lowercase letters, digits and single dashes: what Prefect accepts in an artifact key.

    Text cut to fit ends in a hash of the whole, so two long names that share a prefix differ.
    """
    cleaned = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    if len(cleaned) <= max_length:
        return cleaned
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return f"{cleaned[: max_length - len(digest) - 1].rstrip('-')}-{digest}"


def model_name(model_id: str) -> str:
    """`meta-llama/Llama-3.2-1B-Instruct` (or a local folder) -> `Llama-3.2-1B-Instruct`."""
    return model_id.rstrip("/").rsplit("/", 1)[-1]


def recipe_label(source: str | None) -> str:
    """The preset a rendered recipe came from (`preset:W4A16` -> `W4A16`), else `custom`."""
    return source.removeprefix("preset:") if source and source.startswith("preset:") else "custom"


def display_name(model_id: str, recipe_source: str | None) -> str:
    return f"{model_name(model_id)} {recipe_label(recipe_source)}"


def artifact_key(model_id: str, recipe_source: str | None, kind: str) -> str:
    """`<model>-<recipe>-<kind>`; the kind survives any cut to the length limit."""
    suffix = f"-{slug(kind)}"
    return slug(display_name(model_id, recipe_source), MAX_KEY_LENGTH - len(suffix)) + suffix


def is_web_url(location: str) -> bool:
    return location.startswith(("http://", "https://"))


def location_markdown(location: str, text: str) -> str:
    """A link the Prefect UI opens (http), or the path as code to copy: it opens no file:// link."""
    return f"[{text}]({location})" if is_web_url(location) else f"`{location}`"


# figures


def significant(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else float(f"{value:.{digits}g}")


def significant_text(value: float | None, digits: int = 4) -> str:
    # `g` on the rounded float prints 12350, where `.4g` alone would print 1.235e+04.
    return "—" if value is None else f"{significant(value, digits):g}"


def perplexity(value: float) -> float:
    return round(value, 2)


def percent_points(pct: float) -> str:
    """A figure already in percent: 10 -> `10.0 %`."""
    return f"{pct:.1f} %"


def percent(share: float) -> str:
    """A share in [0, 1] as a percentage: 0.9873 -> `98.7 %`."""
    return percent_points(share * 100)


def percent_change(pct: float) -> str:
    """A change in percent, signed: 3.21 -> `+3.2 %`."""
    return f"{pct:+.1f} %"


# How each evaluate-model metric (params.METRICS) reads in a table.
METRIC_FORMATS = {
    "perplexity_increase_pct": percent_change,
    "kl_divergence": significant,
    "top1_agreement": percent,
    "compressed_perplexity": perplexity,
}


def metric_value(name: str, value: float | None) -> float | str | None:
    return None if value is None else METRIC_FORMATS[name](value)


def duration(seconds: float) -> str:
    """`0.0342` -> `34 ms`, `12.345` -> `12.3 s`."""
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def logit_figures(check: Verification) -> str:
    """The logits comparison of a verification, or "" when it compared none."""
    if check.cosine is None:
        return ""
    figures = (
        f"logits cosine {significant_text(check.cosine)}, "
        f"KL {significant_text(check.kl_divergence)} nats/token, "
        f"top-1 agreement {percent(check.top1_agreement)}"
    )
    if check.logit_limits:  # absent in outputs published before the limits were recorded
        limits = check.logit_limits
        figures += (
            f" (limits: cosine >= {limits['min_cosine']}, KL <= {limits['max_kl']}, "
            f"top-1 >= {percent(limits['min_top1'])})"
        )
    base, compressed = check.base_perplexity, check.compressed_perplexity
    if base and compressed:
        figures += (
            f"; held-out perplexity {significant_text(base)} -> {significant_text(compressed)}, "
            f"recovery {100 * base / compressed:.1f}% (transformers, verify's logits)"
        )
    return figures


# tables


def stage_table(stages: list[StageRecord]) -> str:
    rows = [f"| {s.name} | {duration(s.seconds)} | {'yes' if s.cached else 'no'} |" for s in stages]
    total = sum(s.seconds for s in stages)
    return "\n".join(
        [
            "| stage | time | cached |",
            "|---|---|---|",
            *rows,
            f"| **total** | **{duration(total)}** | |",
        ]
    )


def _worst_first(module: ModuleMetric) -> tuple[int, float]:
    if module.error is None:
        return (2, 0.0)
    if math.isnan(module.error):  # a NaN loss is the worst there is
        return (0, 0.0)
    return (1, -module.error)


def layer_error_table(modules: list[ModuleMetric], limit: int = LAYER_ROWS) -> str:
    """The modules with the largest quantization error first, the worst `limit` of them.

    The error is what llm-compressor logs per module ("METRIC error"): GPTQ's loss,
    sum((w - q)^2 / [H^-1]_ii) / 2 over the weight, where H = 2 X X^T / samples (plus dampening) is built
    from the module's calibration inputs X. It estimates the squared error quantizing adds to the module's
    outputs, summed over output channels, per calibration sample: a relative measure in squared
    activation units, not a percentage.
    """
    ranked = sorted(modules, key=_worst_first)
    shown = ranked[:limit]
    rows = [
        f"| {m.name} | {significant_text(m.error)} | {significant_text(m.seconds)} |" for m in shown
    ]
    left_out = len(ranked) - len(shown)
    note = (
        f"\n\n{left_out} more module(s) with smaller errors are left out; manifest.json "
        "(`modules`) lists them all."
        if left_out
        else ""
    )
    return (
        f"Worst {len(shown)} of {len(ranked)} module(s), largest error first. GPTQ loss estimates "
        "the squared error quantization adds to a module's outputs on the calibration data "
        "(squared activation units, summed over output channels, per sample; lower is better).\n\n"
        "| module | quantization error (GPTQ loss, output squared error) | time (s) |\n"
        "|---|---|---|\n" + "\n".join(rows) + note
    )
