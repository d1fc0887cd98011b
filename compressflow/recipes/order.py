"""Stage order by kind and layer: a modifier may not undo what an earlier one did to the same layers.

`compressflow/recipes/kinds.py` says which kinds may follow which. Here each modifier's layers are
resolved (targets less ignore, SmoothQuant/AWQ mappings' smoothed and balanced layers, rotation
targets) against a model's module names, as compressed-tensors matches them (`re:` is re.match
on the name; any other target is a module's exact name or one of its classes), and two
modifiers in a forbidden order are refused only when they touch a common layer. Without a model,
`check_written` refuses a forbidden pair whose targets and ignore lists are written the same way.

The module table is plain data (name -> class names) so this slice needs no model code: the
adapt-recipe stage builds it from the safetensors headers or the meta model.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from compressflow import compat
from compressflow.errors import RecipeError
from compressflow.recipes import RECIPE_FIELD
from compressflow.recipes.kinds import KIND_OF, forbidden
from compressflow.recipes.tree import iter_modifiers

# llm-compressor's pruning aliases (utils.pytorch.module.expand_special_targets).
_ALIASES = {
    "__ALL_PRUNABLE__": ("Linear", "Conv1d", "Conv2d", "Conv3d"),
    "__ALL_QUANTIZABLE__": ("Linear", "Conv2d", "Conv3d"),
}
# SpinQuant's R1 rotates the residual stream: every layer that reads or writes it.
_EVERY_WEIGHT = ("Linear", "Embedding")
# REAP drops whole experts of MoE blocks.
_EXPERTS = ("re:.*experts",)
SHOWN = 3  # layers named in a refusal


@dataclass(frozen=True)
class Touch:
    """The layers one modifier touches, as written: patterns less ignore."""

    where: str  # "<stage>.<group>"
    name: str
    patterns: tuple[str, ...]
    ignore: tuple[str, ...] = ()
    explicit: bool = True  # False where the library picks defaults from the model (mappings)

    @property
    def stage(self) -> str:
        return self.where.split(".", 1)[0]


def _strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else list(value)
    return tuple(t for item in items for t in _ALIASES.get(str(item), (str(item),)))


def _mapping_layers(mappings: Iterable[Any]) -> tuple[str, ...]:
    """The smoothed and balanced layers of SmoothQuant ([balance, smooth]) or AWQ mappings."""
    layers: list[str] = []
    for mapping in mappings:
        if hasattr(mapping, "smooth_layer"):  # AWQMapping
            layers += [mapping.smooth_layer, *mapping.balance_layers]
        elif isinstance(mapping, dict):
            layers += [
                *_strings(mapping.get("smooth_layer")),
                *_strings(mapping.get("balance_layers")),
            ]
        else:  # [balance layers, smooth layer]
            layers += [*_strings(mapping[0]), *_strings(mapping[-1])]
    return tuple(layers)


def touch_of(where: str, modifier: Any, defaults: Mapping[str, Any] | None = None) -> Touch:
    """The layers `modifier` (a constructed llm-compressor modifier) touches; `defaults` maps a
    smoothing class to the mappings the library picks for the model when it is given none."""
    name = type(modifier).__name__
    ignore = _strings(getattr(modifier, "ignore", None))
    if name == "SpinQuantModifier":
        return Touch(where, name, _EVERY_WEIGHT)
    if name == "REAPPruningModifier":
        return Touch(where, name, _EXPERTS, ignore)
    if hasattr(modifier, "mappings"):  # SmoothQuant, LogarithmicEqualization, AWQ
        mappings = modifier.mappings
        if mappings is None:
            mappings = (defaults or {}).get(name)
            explicit = mappings is not None
            return Touch(where, name, _mapping_layers(mappings or ()), ignore, explicit)
        return Touch(where, name, _mapping_layers(mappings), ignore)
    targets = getattr(modifier, "resolved_targets", None)  # a quantizer's, from its groups
    if targets is None:
        targets = getattr(modifier, "targets", None)
    return Touch(where, name, tuple(sorted(_strings(targets))), tuple(sorted(ignore)))


def touches(places: list[str], modifiers: list[Any], defaults=None) -> list[Touch]:
    """Each modifier's layers, in recipe order: `places` as iter_modifiers names them (before
    `Recipe.from_dict`, which may change the recipe), `modifiers` as it built them."""
    return [touch_of(w, m, defaults) for w, m in zip(places, modifiers, strict=True)]


def _matches(name: str, classes: tuple[str, ...], pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name or pattern in classes


def layers(touch: Touch, modules: Mapping[str, tuple[str, ...]]) -> set[str]:
    """The modules `touch` reaches, and every module inside them (a target may be a parent, such
    as a decoder layer class, whose Linear children another modifier names)."""
    matched = {
        name
        for name, classes in modules.items()
        if any(_matches(name, classes, p) for p in touch.patterns)
        and not any(_matches(name, classes, p) for p in touch.ignore)
    }
    return {name for name in modules if any(a in matched for a in _ancestry(name))}


def _ancestry(name: str) -> Iterable[str]:
    """`name` and the names of the modules that hold it."""
    parts = name.split(".")
    return (".".join(parts[:i]) for i in range(len(parts), 0, -1))


def known_by_headers(touches_: list[Touch], modules: Mapping[str, tuple[str, ...]]) -> bool:
    """Whether header-derived `modules` resolve every pattern: names, `re:` and the classes
    headers can tell apart (Linear, Embedding); otherwise the meta model must."""
    return all(
        touch.explicit
        and all(
            p.startswith("re:") or p in _EVERY_WEIGHT or p in modules
            for p in (*touch.patterns, *touch.ignore)
        )
        for touch in touches_
    )


def pairs(touches_: list[Touch]) -> Iterable[tuple[Touch, Touch]]:
    """The (earlier, later) pairs whose kinds may not run in that order on a common layer."""
    for i, first in enumerate(touches_):
        for second in touches_[i + 1 :]:
            if forbidden(first.name, second.name):
                yield first, second


def may_conflict(recipe: dict[str, Any]) -> bool:
    """Whether any two modifiers of `recipe` are in an order that is forbidden on common layers
    (by class name alone: no library import, no model)."""
    names = [name for _, name, _ in iter_modifiers(recipe)]
    return any(forbidden(a, b) for i, a in enumerate(names) for b in names[i + 1 :])


def refusal(first: Touch, second: Touch, shared: list[str] | None) -> RecipeError:
    """Name both modifiers, their stages, (some of) the layers both touch, and the order that
    works."""
    before, after = KIND_OF[first.name], KIND_OF[second.name]
    if shared is None:
        common = (
            f"the same layers (both target {list(first.patterns)} less "
            f"{list(first.ignore) or 'nothing'})"
        )
    else:
        more = f" and {len(shared) - SHOWN} more" if len(shared) > SHOWN else ""
        common = f"{len(shared)} common layer(s): {', '.join(shared[:SHOWN])}{more}"
    fix = (
        f"put {second.name} before {first.name} ({after.name} then {before.name} is the order "
        "llm-compressor supports), in the same stage or an earlier one"
        if not forbidden(second.name, first.name)
        else f"drop one of {first.name} and {second.name}"
    )
    return RecipeError(
        RECIPE_FIELD,
        f"{second.name} (stage {second.stage}) comes after {first.name} (stage {first.stage}) "
        f"and both touch {common}: {second.name} {after.changes} that {first.name} has already "
        f"{before.done}; {before.why}",
        f"{fix}; or give them disjoint layers (their targets, ignore or mappings)",
    )


def check_written(touches_: list[Touch]) -> None:
    """Without a model: refuse a forbidden pair whose targets and ignore are written the same."""
    for first, second in pairs(touches_):
        same = (first.patterns, first.ignore) == (second.patterns, second.ignore)
        if first.explicit and second.explicit and first.patterns and same:
            raise refusal(first, second, None)


def default_mappings(architecture: str) -> dict[str, Any]:
    """The mappings each smoothing class picks for a model class named `architecture` when the
    recipe gives none (AWQ's and SmoothQuant's registries, else their defaults)."""
    from llmcompressor.modifiers.transform.awq import AWQ_MAPPING_REGISTRY
    from llmcompressor.modifiers.transform.awq import default_mappings as awq_default

    smoothquant = compat.smoothquant_mappings_named(architecture)
    return {
        "AWQModifier": AWQ_MAPPING_REGISTRY.get(architecture, awq_default),
        "SmoothQuantModifier": smoothquant,
        "LogarithmicEqualizationModifier": smoothquant,
    }


def check_model(
    text: str, modules: Mapping[str, tuple[str, ...]], architecture: str, complete: bool
) -> bool:
    """Refuse a forbidden order on layers of this model (in a child: it builds the modifiers
    with llm-compressor). `modules` from headers (`complete` False) may not tell a class target
    apart: then nothing is checked and False says the meta model's table is needed."""
    from llmcompressor.recipe import Recipe

    recipe = yaml.safe_load(text)
    places = [where for where, _, _ in iter_modifiers(recipe)]
    modifiers = Recipe.from_dict(recipe).modifiers
    found = touches(places, modifiers, default_mappings(architecture))
    if not complete and not known_by_headers(found, modules):
        return False
    check_layers(found, modules)
    return True


def check_layers(touches_: list[Touch], modules: Mapping[str, tuple[str, ...]]) -> None:
    """Refuse a forbidden pair that touches at least one common module of `modules`."""
    for first, second in pairs(touches_):
        both = layers(first, modules) & layers(second, modules)
        # Shown in model order, the innermost only (a decoder layer's Linear, not the layer).
        shared = [n for n in modules if n in both and not any(m.startswith(f"{n}.") for m in both)]
        if shared:
            raise refusal(first, second, shared)
