"""Adapt recipe: tailors the rendered recipe to the model's architecture, before any weights load.

Presets are written for dense Llama-like models. For the families in
`compressflow.registries.architectures` this stage adds what they need (routers, shared-expert
gates and vision towers left unquantized, SmoothQuant mappings that fit the family, or no
SmoothQuant where none fits) and notes every change, so the manifest and the log say why the
recipe that ran differs from the one asked for. Mappings or ignore entries the user wrote
always win.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import yaml
from prefect import task
from prefect.cache_policies import NO_CACHE

from compressflow.logs import run_logger
from compressflow.recipes.tree import dump_recipe, iter_modifiers
from compressflow.registries.architectures import ARCHITECTURES, Architecture
from compressflow.reporting import tracking
from compressflow.results import FetchedModel, RenderedRecipe


def model_config(model: FetchedModel) -> dict[str, Any]:
    return json.loads(Path(model.path, "config.json").read_text())


def quantizes(kwargs: dict[str, Any]) -> bool:
    return "scheme" in kwargs or "config_groups" in kwargs


def smoothquant_mappings(rule: Architecture, config: dict[str, Any]):
    """The rule's mappings for this config's layer layout."""
    for conditions, mappings in rule.smoothquant_when:
        if all(config.get(key) == value for key, value in conditions):
            return mappings
    return rule.smoothquant


def apply(
    recipe: dict[str, Any], family: str, rule: Architecture, config: dict[str, Any]
) -> list[str]:
    """Change `recipe` in place as `rule` says; one note per change."""
    notes = []
    mappings = smoothquant_mappings(rule, config)
    for where, name, kwargs in list(iter_modifiers(recipe)):
        if name == "SmoothQuantModifier" and "mappings" not in kwargs:
            if rule.no_smoothquant:
                stage, group = where.split(".")
                del recipe[stage][group][name]
                notes.append(
                    f"{family}: SmoothQuant removed ({rule.no_smoothquant}); the rest of the "
                    "recipe runs without it"
                )
            elif mappings:
                kwargs["mappings"] = [[list(balance), smooth] for balance, smooth in mappings]
                notes.append(f"{family}: SmoothQuant mappings set for the family")
        elif quantizes(kwargs) and rule.ignore:
            ignore = kwargs.get("ignore") or []
            added = [pattern for pattern in rule.ignore if pattern not in ignore]
            if added:
                kwargs["ignore"] = [*ignore, *added]
                notes.append(f"{family}: {name} also ignores {added} ({rule.why})")
    return notes


# Not cached: it takes milliseconds, and a cached result would outlive a change to the rules.
@task(name="adapt recipe", cache_policy=NO_CACHE)
def adapt_recipe(recipe: RenderedRecipe, model: FetchedModel) -> RenderedRecipe:
    """The recipe with the model family's rules applied; unchanged for families without rules."""
    config = model_config(model)
    family = config.get("model_type")
    rule = ARCHITECTURES.get(family)
    if rule is None:
        return recipe.model_copy(update={"architecture": family})
    data = yaml.safe_load(recipe.yaml)
    notes = apply(data, family, rule, config)
    text = dump_recipe(data)
    modifiers = [name for _, name, _ in iter_modifiers(data)]
    adapted = recipe.model_copy(
        update={
            "yaml": text,
            "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
            "modifiers": modifiers,
            "data_modifiers": recipe.data_modifiers - (len(recipe.modifiers) - len(modifiers)),
            "notes": [*recipe.notes, *notes],
            "architecture": family,
            # A migrated recipe's own targets win over the family's.
            "sequential_targets": recipe.sequential_targets
            or list(rule.sequential_targets)
            or None,
        }
    )
    for note in notes:
        run_logger(__name__).info("adapt recipe: %s", note)
    tracking.log_result(adapted)
    return adapted
