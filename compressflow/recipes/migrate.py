"""Step 3: the recipe's shape checked, and forms llm-compressor 0.14 no longer takes rewritten."""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

from compressflow import compat
from compressflow.errors import RecipeError, closest
from compressflow.recipes import RECIPE_FIELD
from compressflow.recipes.tree import iter_modifiers

# The stage a list of modifiers goes into; the name llm-compressor gives its own single stage.
LIST_STAGE, LIST_GROUP = "default_stage", "default_modifiers"
# Observer arguments that conflict with an `observer` dict in llm-compressor 0.14.
_SINGLE_OBSERVER_KEYS = ("weight_observer", "input_observer", "output_observer")
# Modifiers whose `mappings` older llm-compressor also took as a key of SmoothQuant's registry.
_SMOOTHQUANT_LIKE = ("SmoothQuantModifier", "LogarithmicEqualizationModifier")
# Modifiers that took `sequential_targets` before 0.14 made it an argument of oneshot.
_HAD_SEQUENTIAL_TARGETS = ("GPTQModifier", "SparseGPTModifier", "WandaPruningModifier")


def _list_to_stage(items: list[Any]) -> dict[str, Any]:
    group: dict[str, Any] = {}
    for index, item in enumerate(items):
        if not isinstance(item, dict) or not item:
            raise RecipeError(
                RECIPE_FIELD,
                f"list item {index} is {item!r}, not a mapping of modifier name to arguments",
                'write each item as {"GPTQModifier": {"scheme": "W4A16", ...}}',
            )
        for name, kwargs in item.items():
            if name in group:
                raise RecipeError(
                    RECIPE_FIELD,
                    f"{name} appears twice in the list; one stage holds each modifier once",
                    f"use a dict recipe with one `<name>_stage` per {name}",
                )
            group[name] = kwargs
    return {LIST_STAGE: {LIST_GROUP: group}}


def to_recipe_dict(data: Any) -> dict[str, Any]:
    """The recipe as `{<name>_stage: {<group>_modifiers: {Modifier: kwargs}}}`.

    llm-compressor's parser skips keys without those suffixes silently, so a misspelt group would
    drop its modifiers: anything else is refused here.
    """
    recipe = _list_to_stage(data) if isinstance(data, list) else data
    shape = "recipe dicts look like {quant_stage: {quant_modifiers: {GPTQModifier: {...}}}}"
    for stage_key, stage in recipe.items():
        if not str(stage_key).endswith("_stage") or not isinstance(stage, dict):
            raise RecipeError(
                RECIPE_FIELD,
                f"top-level key {stage_key!r} is not a `<name>_stage` mapping",
                f"{shape}; a list of {{Modifier: kwargs}} dicts is also accepted",
            )
        for group_key, group in stage.items():
            if group_key == "run_type":
                continue  # legacy, dropped by migrate_legacy
            if not str(group_key).endswith("_modifiers") or not isinstance(group, dict):
                raise RecipeError(
                    RECIPE_FIELD,
                    f"{stage_key}.{group_key} is not a `<name>_modifiers` mapping",
                    shape,
                )
            for name, kwargs in group.items():
                if not isinstance(kwargs, dict):
                    raise RecipeError(
                        RECIPE_FIELD,
                        f"{stage_key}.{group_key}.{name} holds {kwargs!r}, "
                        "not a mapping of arguments",
                        f"give {name} its arguments as a mapping (`{{}}` for none)",
                    )
    if not any(iter_modifiers(recipe)):
        raise RecipeError(RECIPE_FIELD, "the recipe holds no modifiers", shape)
    return recipe


class Migrated(NamedTuple):
    notes: list[str]
    # Lifted out of the modifiers: oneshot takes them, so the rendered recipe carries them.
    sequential_targets: list[str] | None


def _migrate_observer(where: str, name: str, kwargs: dict[str, Any]) -> str | None:
    observer = kwargs.get("observer")
    if not isinstance(observer, str):
        return None
    both = [k for k in _SINGLE_OBSERVER_KEYS if kwargs.get(k) is not None]
    if both:
        raise RecipeError(
            RECIPE_FIELD,
            f"{name} ({where}) sets observer {observer!r} and {', '.join(both)}; "
            "llm-compressor 0.14 refuses both forms together",
            f"keep only {', '.join(both)}, or write observer: {{weights: {observer}}} alone",
        )
    # 0.14 takes `observer` only as {weights|input|output: name}; a bare name meant weights.
    kwargs["observer"] = {"weights": observer}
    return (
        f"{name} ({where}): legacy observer: {observer} rewritten to "
        f"observer: {{weights: {observer}}} (llm-compressor 0.14 takes a dict)"
    )


def _family_key(name: str) -> str:
    """A family or architecture in one spelling: `LlamaForCausalLM`, `llama` -> `llama`."""
    name = re.sub(r"(ForCausalLM|ForConditionalGeneration|Model)$", "", name)
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _migrate_mappings(where: str, name: str, kwargs: dict[str, Any]) -> str | None:
    given = kwargs.get("mappings")
    if name not in _SMOOTHQUANT_LIKE or not isinstance(given, str):
        return None
    registry = compat.smoothquant_mappings()
    families = {_family_key(arch): arch for arch in registry}
    arch = families.get(_family_key(given))
    if arch is None:
        default = [[["re:.*q_proj", "re:.*k_proj", "re:.*v_proj"], "re:.*input_layernorm"]]
        raise RecipeError(
            RECIPE_FIELD,
            f"{name} ({where}) has mappings: {given!r}, which names no model family "
            f"llm-compressor 0.14 keeps SmoothQuant mappings for (known: {', '.join(families)})",
            f"{closest(_family_key(given), list(families))}use a known family name, remove "
            "mappings to let the model's architecture choose them, or write them out in "
            "llm-compressor 0.14's form, a list of [[balance layer regexes], smooth layer regex], "
            f"e.g. mappings: {json.dumps(default)}",
        )
    # The family's own mappings, written out: the named family decides, as it did before, even
    # when the model is of another family (SmoothQuant's default would follow the model).
    kwargs["mappings"] = [
        [list(mapping.balance_layers), mapping.smooth_layers] for mapping in registry[arch]
    ]
    return (
        f"{name} ({where}): legacy mappings: {given} (a model family name) rewritten to the "
        f"{len(kwargs['mappings'])} mappings llm-compressor 0.14 keeps for {arch}, written out in "
        "the recipe (0.14 takes only a list of [[balance layers], smooth layer])"
    )


def _lift_sequential_targets(recipe: dict[str, Any]) -> tuple[list[str] | None, list[str]]:
    """Remove `sequential_targets` from the modifiers that used to take it: (targets, notes)."""
    found: dict[str, list[str]] = {}
    for where, name, kwargs in iter_modifiers(recipe):
        if name not in _HAD_SEQUENTIAL_TARGETS or "sequential_targets" not in kwargs:
            continue
        value = kwargs.pop("sequential_targets")
        targets = [value] if isinstance(value, str) else value
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise RecipeError(
                RECIPE_FIELD,
                f"{name} ({where}) has sequential_targets {value!r}, not a layer class name or "
                "a list of them",
                "remove it from the modifier and set recipe.sequential_targets, e.g. "
                "[LlamaDecoderLayer]",
            )
        found[f"{name} ({where})"] = targets
    if len({tuple(t) for t in found.values()}) > 1:
        listed = "; ".join(f"{k}: {v}" for k, v in found.items())
        raise RecipeError(
            RECIPE_FIELD,
            f"modifiers give different sequential_targets ({listed}); llm-compressor 0.14 takes "
            "one list, for the whole oneshot run",
            "remove sequential_targets from the modifiers and set recipe.sequential_targets once",
        )
    notes = [
        f"{where}: legacy sequential_targets {targets} moved out of the modifier to oneshot's "
        "sequential_targets (llm-compressor 0.14 takes it only there; recipe.sequential_targets "
        "sets it)"
        for where, targets in found.items()
    ]
    return (next(iter(found.values())) if found else None), notes


def migrate_legacy(recipe: dict[str, Any]) -> Migrated:
    """Rewrite, in place, forms older llm-compressor took and 0.14 refuses; one note per change."""
    notes = []
    for stage_key, stage in recipe.items():
        if "run_type" in stage:
            run_type = stage.pop("run_type")
            notes.append(f"{stage_key}: removed run_type {run_type!r} (0.14 has no run types)")
    for where, name, kwargs in iter_modifiers(recipe):
        for migrate in (_migrate_observer, _migrate_mappings):
            if note := migrate(where, name, kwargs):
                notes.append(note)
    sequential_targets, lifted = _lift_sequential_targets(recipe)
    return Migrated([*notes, *lifted], sequential_targets)
