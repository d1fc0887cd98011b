"""What each kind of modifier does to the layers it touches, and which kinds may follow it there.

Plain data, one entry per kind (llm-compressor 0.14's modifier classes by name). The order check
(compressflow/recipes/order.py) refuses a modifier whose kind is not in `followers` of an earlier
modifier's kind *when both touch a common layer*: modifiers on disjoint layers never conflict.
What the library supports stays allowed: sparsity, smoothing, rotation and expert pruning before
quantization; a KV-cache scheme after the attention's quantization (two quantizers on one layer
are refused by compressflow/model/tracing.py's refuse_quantized_twice, which names the layers).

One table for each kind's meaning: a kind's structural contract for verify (the tensors it may
add, drop or reshape) belongs here as a further field, not in a second registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

QUANTIZATION = "quantization"
SPARSITY = "sparsity"
MASK = "sparsity mask"
SMOOTHING = "smoothing"
ROTATION = "rotation"
EXPERT_PRUNING = "expert pruning"


@dataclass(frozen=True)
class Kind:
    """A kind of modifier: its classes, what it does to a layer, what may come after it."""

    name: str
    classes: tuple[str, ...] = field(metadata={"help": "llm-compressor 0.14 modifier classes."})
    changes: str = field(metadata={"help": "What it does to a layer it touches, present tense."})
    done: str = field(metadata={"help": "The same, as a past participle: 'quantized'."})
    followers: tuple[str, ...] = field(
        metadata={"help": "Kinds that may run after it on the same layers."}
    )
    why: str = field(default="", metadata={"help": "What a kind outside `followers` would do."})


ALL_KINDS = (QUANTIZATION, SPARSITY, MASK, SMOOTHING, ROTATION, EXPERT_PRUNING)

KINDS: dict[str, Kind] = {
    kind.name: kind
    for kind in (
        Kind(
            QUANTIZATION,
            ("QuantizationModifier", "GPTQModifier", "AutoRoundModifier"),
            changes="quantizes weights (and activations)",
            done="quantized",
            # A later quantizer on the same layers re-quantizes them: tracing refuses that with
            # the layers named; a KV-cache scheme after the attention's is the library's order.
            followers=(QUANTIZATION, MASK, EXPERT_PRUNING),
            why="a quantizer's scales fit the weights it saw: rescaling, "
            "rotating or zeroing them afterwards leaves a checkpoint that holds neither result "
            "(llm-compressor runs it as written; verify then fails on quality)",
        ),
        Kind(
            SPARSITY,
            ("SparseGPTModifier", "WandaPruningModifier", "MagnitudePruningModifier"),
            changes="zeroes weights",
            done="zeroed",
            # Scaling keeps zeros zero; quantization after sparsity is llm-compressor's 2:4 order.
            followers=(QUANTIZATION, SPARSITY, MASK, SMOOTHING, EXPERT_PRUNING),
            why="a rotation mixes every weight of a row into every other: the zeros are gone",
        ),
        Kind(
            MASK,
            ("ConstantPruningModifier",),
            changes="keeps zeroed weights at zero",
            done="masked",
            followers=ALL_KINDS,
        ),
        Kind(
            SMOOTHING,
            ("SmoothQuantModifier", "LogarithmicEqualizationModifier", "AWQModifier"),
            changes="rescales weights and norms",
            done="rescaled",
            followers=ALL_KINDS,
        ),
        Kind(
            ROTATION,
            ("QuIPModifier", "SpinQuantModifier"),
            changes="rotates weights and adds transforms",
            done="rotated",
            followers=ALL_KINDS,
        ),
        Kind(
            EXPERT_PRUNING,
            ("REAPPruningModifier",),
            changes="drops experts",
            done="dropped experts of",
            followers=ALL_KINDS,
        ),
    )
}

# Modifier class name -> its kind.
KIND_OF: dict[str, Kind] = {name: kind for kind in KINDS.values() for name in kind.classes}


def forbidden(first: str, second: str) -> bool:
    """Whether modifier class `second` may not follow class `first` on a common layer."""
    before, after = KIND_OF.get(first), KIND_OF.get(second)
    return bool(before and after and after.name not in before.followers)
