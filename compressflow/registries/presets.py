"""Preset recipes: the named recipes a user can pass as `recipe` instead of writing YAML.

Plain data only, so the registry can be listed in docs and the UI without importing
llm-compressor. Each preset is a YAML template whose `$name` placeholders all have a default and a
one-line doc; `recipe_args` override the defaults. `tasks.render_recipe` renders and validates them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Placeholder:
    default: Any
    doc: str


@dataclass(frozen=True)
class Preset:
    description: str
    template: str
    placeholders: dict[str, Placeholder] = field(default_factory=dict)

    def defaults(self) -> dict[str, Any]:
        return {name: p.default for name, p in self.placeholders.items()}


_IGNORE = Placeholder(["lm_head"], "Module names or `re:` patterns left unquantized")
_DAMPENING = Placeholder(0.01, "GPTQ Hessian dampening, as a fraction of its mean diagonal")
_BLOCK_SIZE = Placeholder(128, "Columns GPTQ quantizes per block; memory against speed")

# Keys are the canonical names; lookup is case-insensitive (see render_recipe.find_preset).
PRESETS: dict[str, Preset] = {
    "W4A16": Preset(
        description="GPTQ 4-bit weights (group size 128), 16-bit activations. "
        "Needs calibration data.",
        template="""\
quant_stage:
  quant_modifiers:
    GPTQModifier:
      targets: Linear
      scheme: W4A16
      ignore: $ignore
      dampening_frac: $dampening_frac
      block_size: $block_size
""",
        placeholders={
            "ignore": _IGNORE,
            "dampening_frac": _DAMPENING,
            "block_size": _BLOCK_SIZE,
        },
    ),
    "W8A8": Preset(
        description="SmoothQuant then GPTQ: 8-bit weights and 8-bit activations (int8). "
        "Needs calibration data.",
        template="""\
quant_stage:
  quant_modifiers:
    SmoothQuantModifier:
      smoothing_strength: $smoothing_strength
    GPTQModifier:
      targets: Linear
      scheme: W8A8
      ignore: $ignore
      dampening_frac: $dampening_frac
      block_size: $block_size
""",
        placeholders={
            "smoothing_strength": Placeholder(
                0.8, "How much activation outlier range SmoothQuant moves into the weights (0-1)"
            ),
            "ignore": _IGNORE,
            "dampening_frac": _DAMPENING,
            "block_size": _BLOCK_SIZE,
        },
    ),
    "FP8_DYNAMIC": Preset(
        description="FP8 weights (per channel) and dynamic per-token FP8 activations. Data-free.",
        template="""\
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      targets: Linear
      scheme: FP8_DYNAMIC
      ignore: $ignore
""",
        placeholders={"ignore": _IGNORE},
    ),
}
