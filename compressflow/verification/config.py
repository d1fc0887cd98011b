"""Check 1, quantization config: `config.json` says the weights were saved packed."""

from __future__ import annotations

import json
from pathlib import Path

from compressflow.results import RenderedRecipe, VerificationCheck
from compressflow.verification import Check


def check_quantization_config(staging: Path, recipe: RenderedRecipe) -> VerificationCheck:
    config = json.loads((staging / "config.json").read_text())
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get(
        "quantization_config"
    )
    name = CHECK.name
    if quant is None:
        quantizes = recipe.scheme is not None
        detail = "none in config.json" + (
            f", but the recipe quantizes ({recipe.scheme})" if quantizes else ""
        )
        return VerificationCheck(name=name, passed=not quantizes, detail=detail)
    groups = quant.get("config_groups") or {}
    formats = {quant.get("format")} | {g.get("format") for g in groups.values()}
    formats.discard(None)
    packed = bool(groups) and formats != {"dense"}
    detail = f"{quant.get('quant_method')}, format {', '.join(sorted(formats)) or 'unset'}"
    return VerificationCheck(
        name=name,
        passed=packed or not groups,
        detail=detail if packed or not groups else f"{detail}: the weights were saved unpacked",
    )


CHECK = Check(
    name="quantization config",
    field="recipe",
    fix="the quantized modules were saved unpacked (often a Linear subclass "
    "compressed-tensors does not recognise); report the architecture, and meanwhile use a recipe "
    "whose targets name the module classes, or set output.save_compressed true",
    function=lambda state: check_quantization_config(state.staging, state.recipe),
)
