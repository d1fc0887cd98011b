"""Render recipe: turns any accepted recipe form into one validated llm-compressor recipe.

Accepted forms: `RecipeArgs.preset` (a name from `compressflow.registries.presets`), or in
`RecipeArgs.recipe` YAML text or a path to a .yaml/.yml file holding a recipe mapping
(`<name>_stage: <group>_modifiers: {Modifier: kwargs}`) or a list of `{Modifier: kwargs}`, which
becomes one stage (a dict or list given from Python arrives as YAML text).

Steps, each a plain function so they can be tested without Prefect:
1. `load_recipe`: the form becomes parsed YAML data (YAML only through `yaml.safe_load`).
2. `substitute`: `$name` / `${name}` placeholders in *values* take the `recipe_args` (dict keys are
   never substituted). A value that is exactly one placeholder takes the argument with its type; a
   placeholder inside a longer string is replaced by `str(value)`. Inserted values are not scanned
   again. A `$` not followed by an identifier (the regex `re:.*lm_head$`) is left alone. Missing and
   unused names are errors, so a typo can never leave a half-rendered recipe.
3. `to_recipe_dict` and `migrate_legacy`: lists become one stage; forms llm-compressor 0.14 no
   longer takes (a string `observer`, `run_type`, SmoothQuant `mappings` naming a model family,
   `sequential_targets` inside a modifier) are rewritten, with a note for each. Forms that cannot
   be rewritten (SparseZoo `zoo:` stubs) are refused with the form that replaces them.
4. `validate`: llm-compressor's own parser (`Recipe.from_dict`) builds the modifiers; its errors
   become `RecipeError`s that name the modifier, the field and the fix.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import yaml
from prefect import task
from pydantic import ValidationError

from compressflow import tracking
from compressflow.caching import CACHE_EXPIRATION, LocalSourceAware
from compressflow.errors import RecipeError
from compressflow.logs import run_logger
from compressflow.params import RecipeArgs
from compressflow.recipe_tree import dump_recipe, first_scheme, iter_modifiers
from compressflow.registries.presets import PRESETS, preset_named, resolve_args
from compressflow.results import RenderedRecipe

if TYPE_CHECKING:
    from llmcompressor.modifiers import Modifier


RECIPE_FIELD = "recipe.recipe"
ARGS_FIELD = "recipe.recipe_args"

# `$name` or `${name}`; an identifier is matched whole, so `$damp` never eats `$dampening_frac`.
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
PLACEHOLDER = re.compile(rf"\$(?:\{{(?P<braced>{_IDENT})\}}|(?P<bare>{_IDENT}))")

# The stage a list of modifiers goes into; the name llm-compressor gives its own single stage.
LIST_STAGE, LIST_GROUP = "default_stage", "default_modifiers"
# Observer arguments that conflict with an `observer` dict in llm-compressor 0.14.
_SINGLE_OBSERVER_KEYS = ("weight_observer", "input_observer", "output_observer")
# Pipelines llm-compressor runs as asked; the others are inferred from the modifiers.
_EXPLICIT_PIPELINES = ("basic", "datafree")
# Modifiers whose `mappings` older llm-compressor also took as a key of SmoothQuant's registry.
_SMOOTHQUANT_LIKE = ("SmoothQuantModifier", "LogarithmicEqualizationModifier")
# Modifiers that took `sequential_targets` before 0.14 made it an argument of oneshot.
_HAD_SEQUENTIAL_TARGETS = ("GPTQModifier", "SparseGPTModifier", "WandaPruningModifier")
# A scheme named in a zoo stub (`.../quantization-w8a8-channelwise-dynamic`) -> its preset.
_ZOO_SCHEMES = {"w4a16": "W4A16", "w8a8": "W8A8", "fp8": "FP8_DYNAMIC"}


# ---------------------------------------------------------------- 1. load


def _position(mark: yaml.Mark | None, prefix: str) -> str:
    return f"{prefix} line {mark.line + 1}, column {mark.column + 1}" if mark else ""


def _parse_yaml(text: str, where: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc)
        # The context says where the construct that failed began, e.g. an unclosed [.
        context = getattr(exc, "context", None)
        if context:
            problem += f" ({context}{_position(getattr(exc, 'context_mark', None), ' from')})"
        raise RecipeError(
            RECIPE_FIELD,
            f"{where} is not valid YAML{_position(getattr(exc, 'problem_mark', None), ' at')}: "
            f"{problem}",
            "correct the YAML there; quote values holding `{`, `[`, `:` or `#` "
            '(inside [ ] write "${name}", not ${name})',
        ) from exc


def _not_a_recipe(text: str, parsed: Any) -> RecipeError:
    short = text if len(text) <= 60 else text[:57] + "..."
    close = difflib.get_close_matches(text.strip().upper(), PRESETS, n=3, cutoff=0.5)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return RecipeError(
        RECIPE_FIELD,
        f"{short!r} is not a preset, a .yaml/.yml file, or YAML text describing a recipe "
        f"(it parses to {type(parsed).__name__}, not a mapping or a list)",
        f"{hint}use a preset ({', '.join(PRESETS)}), a path ending in .yaml/.yml, or recipe YAML",
    )


def _zoo_stub(stub: str) -> RecipeError:
    # The stub only named a recipe SparseZoo served; 0.14 cannot fetch it, so nothing to rewrite.
    name = stub.lower()
    preset = next((p for word, p in _ZOO_SCHEMES.items() if word in name and p in PRESETS), None)
    same = (
        f"use preset {preset} for the same scheme ({PRESETS[preset].description.rstrip('.')}), or "
        if preset
        else f"use a preset ({', '.join(PRESETS)}) or "
    )
    return RecipeError(
        RECIPE_FIELD,
        f"{stub!r} is a SparseZoo recipe stub; llm-compressor 0.14 removed zoo stubs (they "
        "downloaded the recipe from SparseZoo), so the recipe it named cannot be loaded",
        f"{same}paste that recipe's YAML into recipe",
    )


def load_recipe(recipe: str) -> tuple[Any, str, str | None]:
    """Parsed recipe data, its source label, and the name of the preset it came from (if one).

    A dict or list recipe arrives as YAML text: RecipeArgs stores every recipe as text.
    """
    if name := preset_named(recipe):
        return _parse_yaml(PRESETS[name].template, f"preset {name}"), f"preset:{name}", name

    single_line = "\n" not in recipe.strip()
    path = Path(recipe.strip()).expanduser()
    if single_line and path.suffix.lower() in (".yaml", ".yml"):
        if not path.is_file():
            raise RecipeError(
                RECIPE_FIELD,
                f"recipe file {recipe.strip()!r} does not exist (looked for {path.resolve()})",
                f"check the path; a relative path starts from the working directory {Path.cwd()}",
            )
        data = _parse_yaml(path.read_text(encoding="utf-8"), f"recipe file {str(path)!r}")
        if not isinstance(data, (dict, list)):
            raise RecipeError(
                RECIPE_FIELD,
                f"recipe file {str(path)!r} holds a {type(data).__name__}, not a recipe mapping "
                "or a list of modifiers",
                "write the recipe as {quant_stage: {quant_modifiers: {GPTQModifier: {...}}}}",
            )
        return data, f"file:{recipe.strip()}", None

    if single_line and recipe.strip().startswith("zoo:"):
        raise _zoo_stub(recipe.strip())
    data = _parse_yaml(recipe, "the recipe text")
    if not isinstance(data, (dict, list)):
        raise _not_a_recipe(recipe, data)
    return data, "yaml", None


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


# ---------------------------------------------------------------- 2. substitute


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
    return _fill(node, values)


# ---------------------------------------------------------------- 3. shape and legacy forms


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
    from llmcompressor.modifiers.transform.smoothquant.utils import MAPPINGS_REGISTRY

    families = {_family_key(arch): arch for arch in MAPPINGS_REGISTRY}
    arch = families.get(_family_key(given))
    if arch is None:
        default = [[["re:.*q_proj", "re:.*k_proj", "re:.*v_proj"], "re:.*input_layernorm"]]
        raise RecipeError(
            RECIPE_FIELD,
            f"{name} ({where}) has mappings: {given!r}, which names no model family "
            f"llm-compressor 0.14 keeps SmoothQuant mappings for (known: {', '.join(families)})",
            f"{_closest(_family_key(given), list(families))}use a known family name, remove "
            "mappings to let the model's architecture choose them, or write them out in "
            "llm-compressor 0.14's form, a list of [[balance layer regexes], smooth layer regex], "
            f"e.g. mappings: {json.dumps(default)}",
        )
    # The family's own mappings, written out: the named family decides, as it did before, even
    # when the model is of another family (SmoothQuant's default would follow the model).
    kwargs["mappings"] = [
        [list(mapping.balance_layers), mapping.smooth_layers] for mapping in MAPPINGS_REGISTRY[arch]
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


# ---------------------------------------------------------------- 4. validate


def _modifier_classes() -> dict[str, type]:
    """Modifier name -> class, as llm-compressor's recipe parser looks them up."""
    from llmcompressor.modifiers import ModifierFactory

    # The same lazy load Recipe.from_dict does; the registries are the factory's only listing.
    if not ModifierFactory._loaded:
        ModifierFactory.refresh()
    classes = {
        **ModifierFactory._main_registry,
        **ModifierFactory._experimental_registry,
        **ModifierFactory._registered_registry,
    }
    classes.pop("Modifier", None)  # the abstract base class is registered too
    return classes


def _closest(word: str, choices: list[str], cutoff: float = 0.5) -> str:
    close = difflib.get_close_matches(word, choices, n=3, cutoff=cutoff)
    return f"did you mean {' or '.join(close)}? " if close else ""


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
        registry = _modifier_classes()
        quantizer = registry["QuantizationModifier"]
        if modifier_cls is registry["AWQModifier"] and field in quantizer.model_fields:
            return _balance_only_fix(kwargs, quantizer, modifier_cls)
        if field in MOVED_FIELDS:
            return MOVED_FIELDS[field]
        fields = [f for f in modifier_cls.model_fields if not f.endswith("_")]
        name = modifier_cls.__name__
        return f"{_closest(field, fields)}remove `{field}` or use a field {name} has"
    if field == "scheme":
        given = error.get("input")
        hint = _closest(given.upper(), list(PRESET_SCHEMES)) if isinstance(given, str) else ""
        return f"{hint}use a preset scheme: {', '.join(PRESET_SCHEMES)}"
    if field == "observer":
        return "write observer as {weights: mse} (keys: weights, input, output)"
    return f"give `{field}` a valid value (see {modifier_cls.__name__}'s docstring)"


def _validation_error(exc: ValidationError, recipe: dict[str, Any]) -> RecipeError:
    registry = _modifier_classes()
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


# Values llm-compressor 0.14 accepts but cannot work with: (low, high, inclusive low), and why.
VALUE_RANGES: dict[str, tuple[float, float, bool, str]] = {
    "dampening_frac": (0.0, 1.0, False, "a fraction of the Hessian's mean diagonal, e.g. 0.01"),
    "block_size": (1, 1 << 20, True, "columns per GPTQ block, e.g. 128"),
    "smoothing_strength": (0.0, 1.0, True, "SmoothQuant's alpha, e.g. 0.8"),
    "sparsity": (0.0, 1.0, True, "the share of weights pruned, e.g. 0.5"),
    "n_grid": (1, 1 << 20, True, "AWQ's grid points, e.g. 20"),
}


def check_ranges(recipe: dict[str, Any]) -> None:
    """Refuse values out of their range, which llm-compressor would take and fail on later."""
    for where, name, kwargs in iter_modifiers(recipe):
        for key, (low, high, inclusive, meaning) in VALUE_RANGES.items():
            value = kwargs.get(key)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if not ((value >= low if inclusive else value > low) and value <= high):
                bound = f"{'[' if inclusive else '('}{low}, {high}]"
                raise RecipeError(
                    ARGS_FIELD,
                    f"{name}.{key} in {where} is {value}, outside {bound} ({meaning})",
                    f"set {key} within {bound} in recipe_args or the recipe",
                )


def validate(recipe: dict[str, Any]) -> list[Modifier]:
    """The modifiers llm-compressor's parser builds; it may change `recipe`, so pass a copy."""
    # Imported here: llm-compressor takes seconds to import, and listing presets must not pay that.
    from llmcompressor.recipe import Recipe

    known = sorted(_modifier_classes())
    for where, name, _ in iter_modifiers(recipe):
        if name not in known:
            raise RecipeError(
                RECIPE_FIELD,
                f"unknown modifier {name!r} in {where}",
                f"{_closest(name, known, cutoff=0.8)}"
                f"llm-compressor 0.14's modifiers: {', '.join(known)}",
            )
    check_ranges(recipe)
    try:
        return Recipe.from_dict(recipe).modifiers
    except ValidationError as exc:
        raise _validation_error(exc, recipe) from exc
    # Errors a modifier raises outside pydantic's validation, e.g. from a helper it calls.
    except (ValueError, TypeError, KeyError) as exc:
        raise RecipeError(
            RECIPE_FIELD,
            f"llm-compressor rejects the recipe: {exc}",
            "change the recipe as the message says",
        ) from exc


# ---------------------------------------------------------------- render


def render(args: RecipeArgs) -> RenderedRecipe:
    """Every step, without Prefect or ClearML: what the task returns."""
    data, source, preset_name = load_recipe(args.source())
    values = dict(args.recipe_args)
    if preset_name:
        values = effective_args(preset_name, values)
    recipe = to_recipe_dict(substitute(data, values))
    notes, sequential_targets = migrate_legacy(recipe)
    if sequential_targets and args.sequential_targets:
        notes.append(
            f"recipe.sequential_targets {args.sequential_targets} given too; it wins over the "
            f"recipe's {sequential_targets}"
        )

    try:
        text = dump_recipe(recipe)
    except yaml.YAMLError as exc:
        raise RecipeError(
            ARGS_FIELD,
            f"the recipe holds a value YAML cannot write: {exc}",
            "use only strings, numbers, booleans, null, lists and mappings",
        ) from exc
    # Validate what oneshot will read back, not the in-memory objects.
    modifiers = validate(yaml.safe_load(text))

    needs_data = any(m.requires_calibration_data for m in modifiers)
    if args.pipeline in _EXPLICIT_PIPELINES:
        pipeline = args.pipeline
        if pipeline == "datafree" and needs_data:
            notes.append("pipeline datafree was asked for, but the modifiers need calibration data")
    else:  # as llmcompressor.pipelines.registry.CalibrationPipeline._infer_pipeline does
        pipeline = "sequential" if needs_data else "datafree"

    return RenderedRecipe(
        yaml=text,
        sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
        source=source,
        modifiers=[type(m).__name__ for m in modifiers],
        scheme=first_scheme(recipe) or preset_name,  # W4AFP8 is written out as config groups
        pipeline=pipeline,
        needs_data=needs_data,
        data_modifiers=sum(m.requires_calibration_data for m in modifiers),
        notes=notes,
        sequential_targets=sequential_targets,
        args=values,
    )


@task(
    name="render recipe",
    # Reused across runs (a warm rerun skips importing llm-compressor to re-validate); a recipe
    # file edited in place changes the key through its stat signature.
    cache_policy=LocalSourceAware(),
    cache_expiration=CACHE_EXPIRATION,
    persist_result=True,
)
def render_recipe(args: RecipeArgs) -> RenderedRecipe:
    """Render, validate and log the recipe; RecipeError says what to fix before any model loads."""
    rendered = render(args)
    log = run_logger(__name__)
    log.info(
        "Recipe from %s: %s, scheme %s, pipeline %s (sha256 %s)",
        rendered.source,
        ", ".join(rendered.modifiers),
        rendered.scheme,
        rendered.pipeline,
        rendered.sha256[:12],
    )
    for note in rendered.notes:
        log.warning("Recipe migrated: %s", note)
    tracking.log_result(rendered)
    return rendered
