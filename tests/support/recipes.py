"""Recipes several test files use: the seed system's W4A16 example, AWQ, the FP4 presets that
need a bf16 model, and the quantizing modifiers of a rendered recipe."""

from __future__ import annotations

import yaml

from compressflow.recipes.tree import iter_modifiers
from compressflow.registries.presets import PRESETS

# The seed system's user guide, W4A16 example, as written there.
SEED_GUIDE_W4A16 = """
quant_stage:
  quant_modifiers:
    GPTQModifier:
      ignore: ["lm_head"]
      scheme: "W4A16"
      targets: "Linear"
      observer: $observer
      dampening_frac: $damp
"""
SEED_GUIDE_W4A16_ARGS = {"observer": "mse", "damp": 0.1}

# Needs an accelerator: refused on a CPU worker, before any weights load.
AWQ = """
- AWQModifier: {}
- QuantizationModifier: {targets: Linear, scheme: W4A16, ignore: [lm_head]}
"""

# compressed-tensors unpacks FP4 weights as bf16, so these run on a bf16 copy of the tiny model.
BF16_PRESETS = {name for name, preset in PRESETS.items() if "bf16" in preset.caveat}


def quantizing_modifiers(yaml_text: str) -> dict[str, dict]:
    """The modifiers of a recipe that quantize (those with a scheme), by name."""
    return {
        name: kwargs
        for _, name, kwargs in iter_modifiers(yaml.safe_load(yaml_text))
        if "scheme" in kwargs or "config_groups" in kwargs
    }
