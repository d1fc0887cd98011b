"""Default limits of verify's logits check, per scheme family: plain data, measured on learned weights.

The logits check compares the compressed model's next-token logits with the base model's on
held-out texts (Python builtins' docstrings). What a healthy output scores depends on how many
bits its weights keep, so each family has its own defaults; a `verify.min_cosine`, `max_kl` or
`min_top1` the user sets always wins.

The limits come from the learned-weights yardstick (`compressflow.demo.yardstick`), never from
random weights, whose near-uniform outputs make every scheme look harmless (KL 0.001 for 4-bit
GPTQ on the tiny random Llama, ten times less than on the yardstick). `MEASURED` holds the worst
figure of each family over every CPU preset and calibration seed, plain round-to-nearest W4A16
included (docs/benchmarks/quality.md, "Verify's limits per family", made by `python -m
benchmarks.quality_table`; on the yardstick's 1500-step build, which the 1000-step one passes with
room: docs/benchmarks/quality.md, "The yardstick now"). Each limit loosens that worst healthy figure by one rule (never past the floor), so an
output as good as the worst recipe measured passes, with room for other models and for the
check's small sample (about 200 positions):

- KL: 3x the worst KL. KL is what tells the families apart: it grows with the damage on learned
  weights (8-bit 0.0004 to 0.003, 4-bit weights 0.006 to 0.03, 4-bit weights and activations
  0.04 to 0.07 here);
- top-1: 3x the worst disagreement (1 - top-1). On about 200 positions top-1 is coarse, so for
  4-bit families this lands at or near the floor;
- cosine: the floor's, whatever the family. The cosine of raw logits follows their scale as much
  as their quality: FP8 on the tiny random Llama scores 0.9976, below 4-bit GPTQ on the yardstick.

`tests/unit/test_thresholds.py` holds the limits to that rule; `tests/matrix/test_yardstick.py`
shows the schemes it runs on the yardstick pass their family's limits with verify's defaults.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class LogitFigures:
    """Mean cosine of logits, mean KL(base || compressed) in nats, top-1 agreement."""

    cosine: float
    kl: float
    top1: float


# Worst healthy figures on the yardstick (verify's 4 texts x 64 tokens), every CPU preset and
# seed of that family and round-to-nearest W4A16; `benchmarks/quality_table.py` prints them.
MEASURED: dict[str, LogitFigures] = {
    # W8A8 and W8A8_GPTQ x 3 seeds, FP8_DYNAMIC, FP8_BLOCK: the worst are FP8's
    "8-bit": LogitFigures(cosine=0.99959, kl=0.0032, top1=0.919),
    # W4A16, W4A16_AUTOROUND, W4AFP8 x 3 seeds, NVFP4A16, round-to-nearest W4A16: the worst is RTN
    "4-bit weights": LogitFigures(cosine=0.99664, kl=0.0288, top1=0.8095),
    # NVFP4 x 3 seeds, MXFP4: the worst is MXFP4 (+7.2% held-out perplexity)
    "4-bit weights and activations": LogitFigures(cosine=0.99211, kl=0.0734, top1=0.7714),
}

KL_FACTOR, TOP1_FACTOR = 3, 3

# The floor: limits that refuse a broken model whatever its scheme (destroyed logits: cosine
# 0.3-0.37, top-1 0-1%); the defaults of schemes we cannot place in a family.
FLOOR = LogitFigures(cosine=0.9, kl=1.0, top1=0.4)


def limits_from(worst: LogitFigures) -> LogitFigures:
    """The rule above: limits a little looser than the worst healthy figure."""
    return LogitFigures(
        cosine=FLOOR.cosine,
        kl=min(FLOOR.kl, round(KL_FACTOR * worst.kl, 4)),
        top1=max(FLOOR.top1, round(1 - TOP1_FACTOR * (1 - worst.top1), 2)),
    )


# Loosest first: a mixed recipe is held to its loosest part's limits.
FAMILY_ORDER = ("other", "4-bit weights and activations", "4-bit weights", "8-bit")

DEFAULTS: dict[str, LogitFigures] = {
    family: limits_from(worst) for family, worst in MEASURED.items()
} | {"other": FLOOR}


# Weight and activation bits of compressed-tensors' preset schemes, by name (the names are
# plain data; importing compressed-tensors to read them would load torch into the flow's process).
_BITS = re.compile(r"^W(\d)A(\d+|FP8)")
_NAMED_BITS = {"FP8": (8, 8), "INT8": (8, 8), "MXFP8A16": (8, 16), "MXFP8": (8, 8)}
_NAMED_BITS |= {"NVFP4A16": (4, 16), "MXFP4A16": (4, 16), "NVFP4": (4, 4), "MXFP4": (4, 4)}


def scheme_family(scheme: str | None) -> str:
    """The family whose limits an output of `scheme` is held to: `8-bit` (W8A8, W8A16, FP8_*),
    `4-bit weights` (W4A16, W4AFP8, NVFP4A16), `4-bit weights and activations` (NVFP4, MXFP4,
    W4A4), or `other` (no scheme, fewer or odd bits, a scheme we cannot name). A mixed recipe
    (`W8A8+W4A16`: scheme -> targets) takes its loosest part's family."""
    families = {_family_of(part) for part in (scheme or "").upper().split("+")}
    return next(f for f in FAMILY_ORDER if f in families)


def _family_of(name: str) -> str:
    bits = next((b for prefix, b in _NAMED_BITS.items() if name.startswith(prefix)), None)
    if bits is None and (match := _BITS.match(name)):
        activations = match.group(2)
        bits = (int(match.group(1)), 8 if activations == "FP8" else int(activations))
    if bits is None:
        return "other"
    weights, activations = bits
    if weights == 8 and activations >= 8:
        return "8-bit"
    if weights == 4:
        return "4-bit weights" if activations >= 8 else "4-bit weights and activations"
    return "other"


# Limits by method: a recipe's kinds beyond quantization, as compressflow/recipes/kinds.py's
# `Contract.method()` names them ("rotation", "expert pruning", "rotation+expert pruning"). A
# method listed here is held to its own limits, measured as MEASURED is (on the yardstick, every
# seed) and loosened by `limits_from`; a method not listed yet takes its scheme family's.
# Measured 2026-12-08 (docs/benchmarks/methods-quality.md), each method with GPTQ W4A16 after it,
# 3 calibration seeds; a method alone costs less than with the 4-bit stage, so its own limits are
# looser than it needs, never tighter.
METHOD_MEASURED: dict[str, LogitFigures] = {
    # W4A16_QUIP (QuIP v-rotations, Hadamard blocks of 128, then GPTQ W4A16) on the yardstick
    "rotation": LogitFigures(cosine=0.99851, kl=0.0139, top1=0.8571),
    # REAP_W4A16 (a quarter of each layer's experts dropped, then GPTQ W4A16) on the MoE
    # yardstick: +8.8% to +9.2% held-out perplexity against the MoE base, which the 4-bit
    # family's KL limit (0.0864) would refuse although every output reloads and serves
    "expert pruning": LogitFigures(cosine=0.98710, kl=0.1557, top1=0.7381),
}
METHOD_DEFAULTS: dict[str, LogitFigures] = {m: limits_from(w) for m, w in METHOD_MEASURED.items()}


def loosest(a: LogitFigures, b: LogitFigures) -> LogitFigures:
    """Each figure's looser limit of the two."""
    return LogitFigures(min(a.cosine, b.cosine), max(a.kl, b.kl), min(a.top1, b.top1))


def default_limits(scheme: str | None, method: str | None = None) -> tuple[LogitFigures, str]:
    """The limits an output of `scheme` made with `method` is held to, and where they come from
    in words (what verify's logits check says it used).

    A measured method's limits, loosened to its scheme family's where those are looser: a
    method was measured with some schemes (METHOD_MEASURED's comments say which), and with a
    scheme that costs more than those it still costs at least what the scheme alone does. With
    no scheme (the method alone, nothing quantized) its own limits hold, not the floor's."""
    family = scheme_family(scheme)
    if method and method in METHOD_DEFAULTS:
        own = METHOD_DEFAULTS[method]
        limits = loosest(own, DEFAULTS[family]) if scheme else own
        source = f"the {method} default" + (f" ({scheme})" if scheme else "")
        if limits != own:
            source += f", loosened to the {family} default where that is looser"
        return limits, source
    source = f"the {family} default" + (f" ({scheme})" if scheme else "")
    if method:
        source += f", as no {method} default is measured yet"
    return DEFAULTS[family], source


def describe() -> str:
    """The defaults in one line, for the parameters' help text."""
    return "; ".join(
        f"{family}: cosine {d.cosine}, KL {d.kl}, top-1 {d.top1}" for family, d in DEFAULTS.items()
    )
