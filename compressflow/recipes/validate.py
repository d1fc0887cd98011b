"""Step 4: llm-compressor's own parser builds the modifiers; its errors name the field and the fix."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import ValidationError

from compressflow import compat
from compressflow.errors import RecipeError, closest
from compressflow.recipes import ARGS_FIELD, RECIPE_FIELD, order
from compressflow.recipes.kinds import sparsity_refusal
from compressflow.recipes.tree import iter_modifiers

if TYPE_CHECKING:
    from llmcompressor.modifiers import Modifier


SEQUENTIAL_FIELD = "recipe.sequential_targets"

# Fields llm-compressor 0.14 moved off a modifier: the fix, preferred over a similar-looking name
# (difflib would offer `targets` for `sequential_targets`, which changes what is quantized).
MOVED_FIELDS: dict[str, str] = {
    "sequential_targets": "remove `sequential_targets` from the modifier and set "
    "recipe.sequential_targets (oneshot's argument in llm-compressor 0.14)",
    "sequential_update": "remove `sequential_update`: llm-compressor 0.14's GPTQ always "
    "updates layer by layer",
}


def _balance_only_fix(kwargs: dict[str, Any], quantizer_cls: type, balancer_cls: type) -> str:
    """AWQ in 0.14 only balances; what it was given to quantize goes to a modifier after it."""
    own = balancer_cls.model_fields
    moved = {k: v for k, v in kwargs.items() if k in quantizer_cls.model_fields and k not in own}
    flow = yaml.safe_dump(moved, default_flow_style=True, sort_keys=False, width=10_000).strip()
    return (
        f"{balancer_cls.__name__} only balances; put a QuantizationModifier {flow} after it "
        f"in the same stage and keep only {balancer_cls.__name__}'s own arguments on it"
    )


def _fix_for(modifier_cls: type, error: dict[str, Any], kwargs: dict[str, Any]) -> str:
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    if not error["loc"]:  # a check across several arguments
        return f"change {modifier_cls.__name__}'s arguments as the message says"
    field = str(error["loc"][0])
    if error["type"] == "extra_forbidden":
        registry = compat.modifier_classes()
        quantizer = registry["QuantizationModifier"]
        if modifier_cls is registry["AWQModifier"] and field in quantizer.model_fields:
            return _balance_only_fix(kwargs, quantizer, modifier_cls)
        if field in MOVED_FIELDS:
            return MOVED_FIELDS[field]
        fields = [f for f in modifier_cls.model_fields if not f.endswith("_")]
        name = modifier_cls.__name__
        return f"{closest(field, fields)}remove `{field}` or use a field {name} has"
    if field == "scheme":
        given = error.get("input")
        hint = closest(given.upper(), list(PRESET_SCHEMES)) if isinstance(given, str) else ""
        return f"{hint}use a preset scheme: {', '.join(PRESET_SCHEMES)}"
    if field == "observer":
        return "write observer as {weights: mse} (keys: weights, input, output)"
    return f"give `{field}` a valid value (see {modifier_cls.__name__}'s docstring)"


def _validation_error(exc: ValidationError, recipe: dict[str, Any]) -> RecipeError:
    registry = compat.modifier_classes()
    name, messages = exc.title, [e["msg"].removeprefix("Value error, ") for e in exc.errors()]
    if name not in registry:  # a check on the whole recipe, e.g. AWQ without a quantizer after it
        return RecipeError(
            RECIPE_FIELD,
            f"llm-compressor rejects the recipe: {'; '.join(messages)}",
            "change the recipe as the message says",
        )
    found = [(w, k) for w, n, k in iter_modifiers(recipe) if n == name]
    where = " or ".join(w for w, _ in found)
    details = [
        f"`{'.'.join(map(str, e['loc'])) or 'arguments'}`: {msg} (got {e.get('input')!r})"
        for e, msg in zip(exc.errors(), messages, strict=True)
    ]
    fixes = dict.fromkeys(_fix_for(registry[name], e, found[0][1]) for e in exc.errors())
    return RecipeError(
        RECIPE_FIELD,
        f"llm-compressor rejects {name} in {where}: {'; '.join(details)}",
        "; ".join(fixes),
    )


def check_sparsity(recipe: dict[str, Any]) -> None:
    """Refuse a sparsity stage (SparseGPT, Wanda, Magnitude pruning with a sparsity above 0):
    nothing verify serves with can serve its output sparse (compressflow/recipes/kinds.py)."""
    for where, name, kwargs in iter_modifiers(recipe):
        if why := sparsity_refusal(name, kwargs):
            raise RecipeError(
                RECIPE_FIELD,
                f"{name} in {where} prunes weights to sparsity, and {why}",
                f"drop the {name} stage from the recipe (quantization alone, or "
                "REAPPruningModifier to drop whole MoE experts, makes the model smaller and "
                "faster in vLLM)",
            )


# Values llm-compressor 0.14 accepts but cannot work with: (low, high, inclusive low), and why.
VALUE_RANGES: dict[str, tuple[float, float, bool, str]] = {
    "dampening_frac": (0.0, 1.0, False, "a fraction of the Hessian's mean diagonal, e.g. 0.01"),
    "block_size": (1, 1 << 20, True, "columns per GPTQ block, e.g. 128"),
    "smoothing_strength": (0.0, 1.0, True, "SmoothQuant's alpha, e.g. 0.8"),
    "sparsity": (0.0, 1.0, True, "the share of weights pruned, e.g. 0.5"),
    "n_grid": (1, 1 << 20, True, "AWQ's grid points, e.g. 20"),
}


def _as_number(value: Any) -> float | None:
    """The number llm-compressor's pydantic makes of `value`, which coerces strings ("-0.5",
    "inf", "0") too; None for what it would not take as one (its own check then refuses it)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    try:
        return float(value) if isinstance(value, str) else None
    except ValueError:
        return None


def check_ranges(recipe: dict[str, Any]) -> None:
    """Refuse values out of their range, which llm-compressor would take and fail on later."""
    for where, name, kwargs in iter_modifiers(recipe):
        for key, (low, high, inclusive, meaning) in VALUE_RANGES.items():
            value = kwargs.get(key)
            if (number := _as_number(value)) is None:
                continue
            if not ((number >= low if inclusive else number > low) and number <= high):
                bound = f"{'[' if inclusive else '('}{low}, {high}]"
                raise RecipeError(
                    ARGS_FIELD,
                    f"{name}.{key} in {where} is {value!r}, outside {bound} ({meaning})",
                    f"set {key} within {bound} in recipe_args or the recipe",
                )


# The parts of a config group that hold quantization arguments (num_bits, group_size, ...).
QUANTIZATION_ARGS = ("weights", "input_activations", "output_activations")


def check_group_sizes(recipe: dict[str, Any]) -> None:
    """Refuse a group_size that is not a whole number, naming where it is set.

    compressed-tensors compares it with a number before pydantic converts it, so text (YAML reads
    `1e400` or `128 MB` as a string), a list or a mapping failed with "'<' not supported between
    instances of 'str' and 'int'", naming nothing; and `true` passed as a group of one weight.
    """
    for where, name, kwargs in iter_modifiers(recipe):
        groups = kwargs.get("config_groups")
        places = [
            (f"config_groups.{group}.{part}", scheme.get(part))
            for group, scheme in (groups.items() if isinstance(groups, dict) else [])
            if isinstance(scheme, dict)
            for part in QUANTIZATION_ARGS
        ]
        for place, args in [*places, ("kv_cache_scheme", kwargs.get("kv_cache_scheme"))]:
            value = args.get("group_size") if isinstance(args, dict) else None
            if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
                continue
            raise RecipeError(
                RECIPE_FIELD,
                f"{name}.{place}.group_size in {where} is {value!r} ({type(value).__name__}), "
                "not a whole number",
                f"write group_size in {place} as a plain integer, e.g. 128 (a number with an "
                "exponent such as 1e400 and quoted values are read as text)",
            )


# What marks a regular expression in targets, ignore and mappings (compressed-tensors).
PATTERN_PREFIX = "re:"


def _patterns(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """(field path, pattern) for every `re:` string inside `value`, however deep."""
    if isinstance(value, str):
        if value.startswith(PATTERN_PREFIX):
            yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _patterns(item, f"{path}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _patterns(item, f"{path}[{i}]")


def check_patterns(recipe: dict[str, Any], sequential_targets: Any = None) -> None:
    """Refuse a `re:` pattern Python's `re` cannot compile (targets, ignore, mappings,
    sequential_targets: compressed-tensors' match_name runs `re.match(pattern[3:], name)`), naming
    the modifier, the field and re's words; the library raised it only once calibration began."""
    found = [
        (f"{name}.{path.lstrip('.')} in {where}", pattern, RECIPE_FIELD)
        for where, name, kwargs in iter_modifiers(recipe)
        for path, pattern in _patterns(kwargs, "")
    ]
    found += [(f"entry {p}", s, SEQUENTIAL_FIELD) for p, s in _patterns(sequential_targets, "")]
    for place, pattern, field in found:
        try:
            re.compile(pattern.removeprefix(PATTERN_PREFIX))
        except re.error as exc:
            raise RecipeError(
                field,
                f"the pattern {pattern!r} ({place}) is not a regular expression Python can "
                f"compile: {exc}",
                "write a Python regular expression after `re:` (escape a literal `.`, `(`, `[` "
                r"or `+` with `\`), e.g. 're:.*self_attn\.(q|k|v)_proj$'",
            ) from exc


def validate(recipe: dict[str, Any]) -> list[Modifier]:
    """The modifiers llm-compressor's parser builds; it may change `recipe`, so pass a copy."""
    # Imported here: llm-compressor takes seconds to import, and listing presets must not pay that.
    from llmcompressor.recipe import Recipe

    known = sorted(compat.modifier_classes())
    for where, name, _ in iter_modifiers(recipe):
        if name not in known:
            raise RecipeError(
                RECIPE_FIELD,
                f"unknown modifier {name!r} in {where}",
                f"{closest(str(name), known, cutoff=0.8)}"  # YAML keys may be ints or null
                f"llm-compressor 0.14's modifiers: {', '.join(known)}",
            )
    check_sparsity(recipe)  # before the order check, which refuses some sparsity orders
    check_ranges(recipe)
    check_group_sizes(recipe)
    places = [where for where, _, _ in iter_modifiers(recipe)]  # from_dict may change `recipe`
    try:
        modifiers = Recipe.from_dict(recipe).modifiers
    except ValidationError as exc:
        raise _validation_error(exc, recipe) from exc
    # Errors a modifier raises outside pydantic's validation, e.g. from a helper it calls;
    # compressed-tensors' NotImplementedError for a num_bits it has no dtype for.
    except (ValueError, TypeError, KeyError, NotImplementedError) as exc:
        raise RecipeError(
            RECIPE_FIELD,
            f"llm-compressor rejects the recipe: {exc}",
            "change the recipe as the message says",
        ) from exc
    check_bit_widths(modifiers)
    # The layers are known only with the model (tasks/adapt_recipe.py checks them there); a
    # forbidden order on targets written the same way needs none.
    order.check_written(order.touches(places, modifiers))
    return modifiers


# Integer widths: compressed-tensors packs at most 8 bits, and 1 bit leaves two levels. llm-
# compressor's parser takes any int (0, -3, 1000) and nothing else looked before calibration.
# (vLLM's kernels load 4 and 8; the serve check reports the rest.) Float widths other than FP4
# and FP8 compressed-tensors refuses itself.
INT_BITS = range(2, 9)


def check_bit_widths(modifiers: list[Modifier]) -> None:
    """Refuse an integer num_bits outside `INT_BITS`, naming the modifier and where it is set;
    and a modifier whose quantization llm-compressor resolves only when calibration starts."""
    for modifier in modifiers:
        if not compat.is_quantizing_modifier(modifier):
            continue
        name = type(modifier).__name__
        try:
            config = modifier.resolve_quantization_config()
        except ValueError as exc:  # e.g. both `scheme` and `config_groups`, which the parser takes
            raise RecipeError(
                RECIPE_FIELD,
                f"llm-compressor cannot resolve {name}'s quantization: {exc}",
                "keep one of `scheme` and `config_groups` in the modifier (a preset name in "
                "`scheme` is the short form)",
            ) from exc
        parts = [
            (f"config_groups.{group}.{part}", getattr(scheme, part))
            for group, scheme in config.config_groups.items()
            for part in QUANTIZATION_ARGS
        ]
        for where, args in [*parts, ("kv_cache_scheme", config.kv_cache_scheme)]:
            if args is not None and args.type == "int" and args.num_bits not in INT_BITS:
                raise RecipeError(
                    RECIPE_FIELD,
                    f"{name} asks for {args.num_bits}-bit integers in {where}, outside 2 to 8 "
                    "bits (compressed-tensors stores at most 8)",
                    f"set num_bits in {where} to 4 (as W4A16) or 8 (as W8A8), or use a preset",
                )
