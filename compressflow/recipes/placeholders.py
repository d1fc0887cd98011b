"""Step 2: `$name` / `${name}` placeholders in values take `recipe_args`; nothing is left half-done."""

from __future__ import annotations

import copy
import difflib
import re
from typing import Any

from compressflow.errors import RecipeError
from compressflow.limits import MAX_NODES, MAX_TEXT_BYTES, check_data
from compressflow.recipes import ARGS_FIELD
from compressflow.registries.presets import PRESETS, resolve_args

# `$name` or `${name}`; an identifier is matched whole, so `$damp` never eats `$dampening_frac`.
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
PLACEHOLDER = re.compile(rf"\$(?:\{{(?P<braced>{_IDENT})\}}|(?P<bare>{_IDENT}))")


def effective_args(preset_name: str, recipe_args: dict[str, Any]) -> dict[str, Any]:
    """A preset's defaults overridden by `recipe_args`; names the preset lacks are refused."""
    preset = PRESETS[preset_name]
    unknown = sorted(set(recipe_args) - set(preset.placeholders))
    if unknown:
        documented = "; ".join(
            f"{n} (default {p.default!r}): {p.doc}" for n, p in preset.placeholders.items()
        )
        raise RecipeError(
            ARGS_FIELD,
            f"preset {preset_name} has no placeholder {', '.join(unknown)}; its placeholders are: "
            f"{documented}",
            f"remove {', '.join(unknown)} or use the names above; for other changes pass the "
            f"preset's YAML (compressflow.registries.presets.PRESETS[{preset_name!r}].template) edited",
        )
    return resolve_args(preset_name, {**preset.defaults(), **recipe_args})


def _names_in(text: str) -> set[str]:
    return {m["braced"] or m["bare"] for m in PLACEHOLDER.finditer(text)}


def find_placeholders(node: Any) -> set[str]:
    """Placeholder names used in the values of `node` (dict keys are not searched)."""
    if isinstance(node, str):
        return _names_in(node)
    if isinstance(node, dict):
        return set().union(*(find_placeholders(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(find_placeholders(v) for v in node))
    return set()


def _fill(node: Any, values: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        return {k: _fill(v, values) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill(v, values) for v in node]
    if not isinstance(node, str):
        return node
    whole = PLACEHOLDER.fullmatch(node)
    if whole:
        # Copied so that one list used twice is two YAML values, not an alias of one object.
        return copy.deepcopy(values[whole["braced"] or whole["bare"]])
    return PLACEHOLDER.sub(lambda m: str(values[m["braced"] or m["bare"]]), node)


def _check_growth(node: Any, values: dict[str, Any]) -> None:
    """Refuse before filling: a recipe and values each within the limits still multiply when one
    large value is inserted at many places."""
    sizes = {name: check_data(value, ARGS_FIELD, RecipeError) for name, value in values.items()}
    # str(value)'s length, about: its text plus a bracket, quote or comma per value.
    lengths = {name: chars + nodes for name, (nodes, chars) in sizes.items()}
    nodes = chars = 0
    stack = [node]
    while stack:  # the loaded recipe is at most MAX_NODES values, as expanded
        item = stack.pop()
        nodes += 1
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str) and (whole := PLACEHOLDER.fullmatch(item)):
            nodes += sizes[whole["braced"] or whole["bare"]][0] - 1
        elif isinstance(item, str):
            chars += sum(lengths[m["braced"] or m["bare"]] for m in PLACEHOLDER.finditer(item))
    if nodes > MAX_NODES or chars > MAX_TEXT_BYTES:
        raise RecipeError(
            ARGS_FIELD,
            f"the recipe with its placeholders filled would hold {nodes:,} values and about "
            f"{chars:,} characters of inserted text, over the limits of {MAX_NODES:,} values "
            f"and {MAX_TEXT_BYTES:,} characters",
            "use each large value at fewer places, or make it smaller",
        )


def substitute(node: Any, values: dict[str, Any]) -> Any:
    """`node` with every placeholder replaced; RecipeError naming all missing and unused names."""
    used = find_placeholders(node)
    missing, unused = sorted(used - set(values)), sorted(set(values) - used)
    if missing or unused:
        problems, fixes = [], []
        if missing:
            problems.append(f"placeholders without a value: {', '.join('$' + n for n in missing)}")
            fixes.append(f"add {', '.join(missing)} to recipe_args")
        if unused:
            existing = ", ".join("$" + n for n in sorted(used)) or "none"
            problems.append(
                f"recipe_args that no placeholder uses: {', '.join(unused)} (the recipe's "
                f"placeholders: {existing}; only values are substituted, never keys)"
            )
            typos = [
                f"{n} -> {close[0]}"
                for n in unused
                if (close := difflib.get_close_matches(n, missing, n=1, cutoff=0.6))
            ]
            fixes.append(
                f"remove {', '.join(unused)} from recipe_args"
                + (f" or fix the spelling ({', '.join(typos)})" if typos else "")
            )
        raise RecipeError(ARGS_FIELD, "; ".join(problems), "; ".join(fixes))
    _check_growth(node, values)
    return _fill(node, values)
