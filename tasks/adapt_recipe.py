"""Adapt recipe: tailors the rendered recipe to the model's architecture, before any weights load.

Presets are written for dense Llama-like models. For the families in
`compressflow.registries.architectures` this stage adds what they need (routers and shared-expert
gates left unquantized, SmoothQuant mappings that fit the family, or no SmoothQuant where none
fits). For any vision-language model, whatever its family, the quantization modifiers leave out
every module outside the language model (vision tower, projector), found on the meta model. Every
change is noted, so the manifest and the log say why the recipe that ran differs from the one
asked for. Mappings or ignore entries the user wrote always win.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from prefect import task
from prefect.cache_policies import NO_CACHE

from compressflow.logs import run_logger
from compressflow.model.modules import header_modules, meta_modules
from compressflow.model.tracing import meta_vision_modules
from compressflow.recipes import order
from compressflow.recipes.tree import add_ignore, dump_recipe, iter_modifiers, quantizes
from compressflow.registries.architectures import ARCHITECTURES, Architecture
from compressflow.reporting import tracking
from compressflow.results import FetchedModel, RenderedRecipe
from compressflow.runtime.isolation import in_child
from compressflow.store.identity import recipe_sha256


def model_config(model: FetchedModel) -> dict[str, Any]:
    return json.loads(Path(model.path, "config.json").read_text())


def vision_modules(model: FetchedModel, config: dict[str, Any]) -> list[str]:
    """Modules outside the language model (compressflow.model.tracing.outside_text_model); the
    meta model is built only for configs with a sub-config besides the text one."""
    if not any(key.endswith("_config") and key != "text_config" for key in config):
        return []
    return in_child(meta_vision_modules, model)


def subtree(path: str) -> str:
    """An ignore pattern for the module at `path` and everything under it, under transformers 5's
    name (`model.vision_tower...`) and 4's (`vision_tower...`) alike."""
    return rf"re:(.*\.)?{re.escape(path.rsplit('.', 1)[-1])}($|\.)"


def aims_at(kwargs: dict[str, Any], modules: Sequence[str]) -> bool:
    """Whether a modifier's own targets name one of `modules`: then the user asked for it."""
    groups = (kwargs.get("config_groups") or {}).values()
    targets = str([kwargs.get("targets"), *(group.get("targets") for group in groups)])
    return any(path.rsplit(".", 1)[-1] in targets for path in modules)


def smoothquant_mappings(rule: Architecture, config: dict[str, Any]):
    """The rule's mappings for this config's layer layout."""
    for conditions, mappings in rule.smoothquant_when:
        if all(config.get(key) == value for key, value in conditions):
            return mappings
    return rule.smoothquant


def apply(
    recipe: dict[str, Any],
    family: str,
    rule: Architecture,
    config: dict[str, Any],
    vision: Sequence[str] = (),
) -> list[str]:
    """Change `recipe` in place as `rule` says, leaving `vision` unquantized; a note per change."""
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
        elif quantizes(kwargs):
            if added := add_ignore(kwargs, list(rule.ignore)):
                notes.append(f"{family}: {name} also ignores {added} ({rule.why})")
            if vision and not aims_at(kwargs, vision):
                # A `Linear` target matches the vision tower too, subclasses included (SigLIP's
                # attention-pool head): a text scheme leaves all outside the language model.
                add_ignore(kwargs, [subtree(path) for path in vision])
                notes.append(
                    f"{family}: {name} leaves {', '.join(vision)} unquantized (outside the "
                    "language model; name them in the modifier's targets to quantize them)"
                )
    return notes


def check_stage_order(text: str, model: FetchedModel, config: dict[str, Any]) -> None:
    """Refuse two modifiers in an order their kinds forbid on a layer both touch
    (compressflow/recipes/order.py), on this model's modules: from the safetensors headers
    where they tell enough, else from the meta model. Only for recipes whose class names alone
    allow a conflict, so a preset pays nothing."""
    if not order.may_conflict(yaml.safe_load(text)):
        return
    architecture = next(iter(config.get("architectures") or []), "")
    modules = header_modules(Path(model.path))
    if modules and in_child(order.check_model, text, modules, architecture, False):
        return
    modules, architecture = in_child(meta_modules, model)
    in_child(order.check_model, text, modules, architecture, True)


# Not cached: it takes milliseconds, and a cached result would outlive a change to the rules.
@task(name="adapt recipe", cache_policy=NO_CACHE)
def adapt_recipe(recipe: RenderedRecipe, model: FetchedModel) -> RenderedRecipe:
    """The recipe with the model family's rules applied and, for a vision-language model, its
    vision modules left unquantized; unchanged for text families without rules."""
    config = model_config(model)
    family = config.get("model_type")
    vision = vision_modules(model, config)
    if family not in ARCHITECTURES and not vision:
        check_stage_order(recipe.yaml, model, config)
        return recipe.model_copy(update={"architecture": family})
    rule = ARCHITECTURES.get(family) or Architecture(why="no family rule")
    data = yaml.safe_load(recipe.yaml)
    notes = apply(data, family, rule, config, vision)
    text = dump_recipe(data)
    check_stage_order(text, model, config)
    modifiers = [name for _, name, _ in iter_modifiers(data)]
    adapted = recipe.model_copy(
        update={
            "yaml": text,
            "sha256": recipe_sha256(text),
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
