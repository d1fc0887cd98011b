"""What each kind of modifier does to the layers it touches, and which kinds may follow it there.

Plain data, one entry per kind (llm-compressor 0.14's modifier classes by name). The order check
(compressflow/recipes/order.py) refuses a modifier whose kind is not in `followers` of an earlier
modifier's kind *when both touch a common layer*: modifiers on disjoint layers never conflict.
What the library supports stays allowed: sparsity, smoothing, rotation and expert pruning before
quantization; a KV-cache scheme after the attention's quantization (two quantizers on one layer
are refused by compressflow/model/tracing.py's refuse_quantized_twice, which names the layers).

One table for each kind's meaning, its structural contract included: what a checkpoint made by
the kind may differ from its source by (`contract`). Verify's tensor names check
(compressflow/verification/names.py) holds an output to the union of what the recipe's kinds
allow (`contract_of`, from the rendered recipe) and refuses anything else, naming the tensor. A
kind whose outputs nothing we verify with can serve says why in `refused`: a recipe holding it
is refused at render (compressflow/recipes/validate.py), before calibration.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from compressflow.recipes.tree import iter_modifiers

QUANTIZATION = "quantization"
SPARSITY = "sparsity"
MASK = "sparsity mask"
SMOOTHING = "smoothing"
ROTATION = "rotation"
EXPERT_PRUNING = "expert pruning"

# What a checkpoint may differ from its source by (a kind's `contract`); with none of them every
# tensor keeps its source name and shape.
PARAMETERS = "quantization parameters"  # packed weights, scale, zero_point, g_idx... on modules
TRANSFORMS = "declared transforms"  # the tensors of config.json's transform_config, online ones
EXPERTS = "whole experts"  # of the MoE layers it touched; router rows and expert count follow

# vLLM 0.32, which verify serves with, refuses sparse checkpoints and compressed-tensors 0.19
# saves the zeros dense: a sparsity stage costs quality and buys neither size nor speed.
SPARSE_REFUSED = (
    'vLLM 0.32, the server verify checks with, removed sparse checkpoints ("Sparsity support has '
    'been removed from compressed-tensors") and compressed-tensors 0.19 saves the zeros as dense '
    "weights: nothing we verify with could serve it sparse, so the pruning would only lose quality"
)


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
    contract: tuple[str, ...] = field(
        default=(),
        metadata={"help": "What its checkpoint may differ from the source by (PARAMETERS, ...)."},
    )
    refused: str = field(
        default="", metadata={"help": "Why a recipe holding it is refused at render ('': not)."}
    )


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
            # Names and shapes kept otherwise: a packed weight is saved as weight_packed.
            contract=(PARAMETERS,),
        ),
        Kind(
            SPARSITY,
            ("SparseGPTModifier", "WandaPruningModifier", "MagnitudePruningModifier"),
            changes="zeroes weights",
            done="zeroed",
            # Scaling keeps zeros zero; quantization after sparsity is llm-compressor's 2:4 order.
            followers=(QUANTIZATION, SPARSITY, MASK, SMOOTHING, EXPERT_PRUNING),
            why="a rotation mixes every weight of a row into every other: the zeros are gone",
            refused=SPARSE_REFUSED,
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
            # What is fused into the weights (QuIP's and SpinQuant R1/R2's weight_* locations)
            # adds nothing; an online transform (input, output, q_attn, k_cache) adds its tensor.
            contract=(TRANSFORMS,),
        ),
        Kind(
            EXPERT_PRUNING,
            ("REAPPruningModifier",),
            changes="drops experts",
            done="dropped experts of",
            followers=ALL_KINDS,
            contract=(EXPERTS,),
        ),
    )
}

# Modifier class name -> its kind.
KIND_OF: dict[str, Kind] = {name: kind for kind in KINDS.values() for name in kind.classes}


def forbidden(first: str, second: str) -> bool:
    """Whether modifier class `second` may not follow class `first` on a common layer."""
    before, after = KIND_OF.get(first), KIND_OF.get(second)
    return bool(before and after and after.name not in before.followers)


def sparsity_refusal(name: str, kwargs: Any) -> str | None:
    """Why modifier `name` with `kwargs` is refused (a sparsity stage that zeroes weights), or
    None. ConstantPruningModifier zeroes nothing (it keeps weights already zero at zero), and a
    pruner asked for no sparsity (`sparsity: 0`, Magnitude's `final_sparsity: 0`) prunes none."""
    kind = KIND_OF.get(name)
    if kind is None or not kind.refused:
        return None
    given = kwargs if isinstance(kwargs, dict) else {}
    shares = [given.get(key) for key in ("sparsity", "init_sparsity", "final_sparsity")]
    numbers = [s for s in shares if isinstance(s, (int, float)) and not isinstance(s, bool)]
    if numbers and not any(numbers):
        return None
    return kind.refused


@dataclass(frozen=True)
class Contract:
    """What one recipe's output may differ from its source by: the union of its kinds'
    `contract`, with the layers expert pruning touches (every MoE layer but those its `ignore`
    names, as REAP's re.search matches them) and the share of experts it drops from each."""

    kinds: tuple[str, ...] = ()  # the recipe's kinds, in order, each once
    allows: frozenset[str] = frozenset()
    expert_share: float = 0.0
    expert_ignore: tuple[str, ...] = ()

    def prunes(self, layer: str) -> bool:
        """Whether expert pruning touched MoE layer `layer` (by its module name)."""
        return EXPERTS in self.allows and not any(re.search(p, layer) for p in self.expert_ignore)

    def method(self) -> str | None:
        """The key method-specific limits are looked up by: the kinds beyond quantization
        (`rotation`, `expert pruning`, `rotation+expert pruning`), None for quantization alone."""
        beyond = [k for k in self.kinds if KINDS[k].contract and k != QUANTIZATION]
        return "+".join(beyond) or None


def contract_of(recipe: dict[str, Any]) -> Contract:
    """The contract of a rendered recipe (its YAML as data): which kinds ran, and where."""
    kinds: list[str] = []
    share, ignore = 0.0, []
    for _, name, kwargs in iter_modifiers(recipe):
        kind = KIND_OF.get(name)
        if kind is None:
            continue
        kinds += [kind.name] if kind.name not in kinds else []
        if kind.name == EXPERT_PRUNING and isinstance(kwargs, dict):
            share = max(share, float(kwargs.get("sparsity") or 0))
            given = kwargs.get("ignore") or []
            ignore += [given] if isinstance(given, str) else list(given)
    allows = frozenset(a for k in kinds for a in KINDS[k].contract)
    return Contract(tuple(kinds), allows, share, tuple(ignore))
