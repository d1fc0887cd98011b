"""Every step of the recipe engine in order, without Prefect or ClearML."""

from __future__ import annotations

from typing import Any

import yaml

from compressflow.errors import RecipeError
from compressflow.params import RecipeArgs
from compressflow.recipes import ARGS_FIELD, RECIPE_FIELD
from compressflow.recipes.load import load_recipe
from compressflow.recipes.migrate import migrate_legacy, to_recipe_dict
from compressflow.recipes.placeholders import effective_args, substitute
from compressflow.recipes.tree import dump_recipe, first_scheme, iter_modifiers, quantizes
from compressflow.recipes.validate import check_patterns, validate
from compressflow.registries.presets import KV_CACHE_FP8, KV_CACHE_SCHEMES
from compressflow.results import RenderedRecipe
from compressflow.store.identity import recipe_sha256

# Pipelines llm-compressor runs as asked; the others are inferred from the modifiers.
_EXPLICIT_PIPELINES = ("basic", "datafree")
KV_CACHE_FIELD = "recipe.kv_cache"
PRUNE_FIELD = "recipe.prune_experts"
REAP = "REAPPruningModifier"
PRUNE_STAGE = "expert_pruning_stage"


def fill(args: RecipeArgs) -> tuple[dict[str, Any], str, str | None, dict[str, Any]]:
    """Steps 1 and 2 and the recipe's shape: (recipe, source, preset name, the values filled in).

    No library is imported: the flow checks these in its own process before any child starts
    (flows/checks.py `precheck`). The YAML parses, the preset exists, every placeholder has a
    value, every recipe_args is used and every `re:` pattern compiles.
    """
    data, source, preset_name = load_recipe(args.source())
    values = dict(args.recipe_args)
    if preset_name:
        values = effective_args(preset_name, values)
        if args.kv_cache != "off":
            given = values.get("kv_cache_scheme")
            values["kv_cache_scheme"] = kv_cache_scheme(args, given, ARGS_FIELD)
    recipe = to_recipe_dict(substitute(data, values))
    if args.prune_experts:
        recipe = with_expert_pruning(recipe, args.prune_experts)
    check_patterns(recipe, args.sequential_targets)
    if not preset_name and args.kv_cache != "off":
        add_kv_cache(recipe, args)
    return recipe, source, preset_name, values


def with_expert_pruning(recipe: dict[str, Any], fraction: float) -> dict[str, Any]:
    """`recipe` after a first stage that drops `fraction` of each MoE layer's experts (REAP).

    First, as llm-compressor's REAP examples order it: the quantizer then calibrates only the
    experts kept. Whether the model has experts to drop is the model's to say: checked once it
    is fetched (compressflow/model/methods_fit.py).
    """
    given = [where for where, name, _ in iter_modifiers(recipe) if name == REAP]
    if given or PRUNE_STAGE in recipe:
        raise RecipeError(
            PRUNE_FIELD,
            f"prune_experts is {fraction}, and the recipe already has "
            f"{f'a {REAP} in {given[0]}' if given else f'a stage named {PRUNE_STAGE}'}",
            f"keep one: set recipe.prune_experts to 0, or remove the recipe's own {REAP}"
            if given
            else f"rename the recipe's {PRUNE_STAGE}, or set recipe.prune_experts to 0",
        )
    return {PRUNE_STAGE: {"pruning_modifiers": {REAP: {"sparsity": fraction}}}, **recipe}


def kv_cache_scheme(args: RecipeArgs, given: Any, where: str) -> dict[str, Any]:
    """The scheme `recipe.kv_cache` names, refused when `where` sets kv_cache_scheme to another.

    Empty (null or absent) takes it: a recipe.yaml a run published holds `kv_cache_scheme: null`.
    """
    scheme = KV_CACHE_SCHEMES[args.kv_cache]
    if given is not None and given != scheme:
        raise RecipeError(
            KV_CACHE_FIELD,
            f"kv_cache is {args.kv_cache}, but {where} sets kv_cache_scheme to another scheme, "
            f"{given!r}",
            f"keep one of the two: set recipe.kv_cache off, or remove kv_cache_scheme from {where}",
        )
    return dict(scheme)


def add_kv_cache(recipe: dict[str, Any], args: RecipeArgs) -> None:
    """`recipe.kv_cache` on a recipe of the user's own: each quantizing modifier gets its
    kv_cache_scheme (llm-compressor attaches the KV cache's scales with a modifier's scheme)."""
    quantizers = [(where, name, kw) for where, name, kw in iter_modifiers(recipe) if quantizes(kw)]
    if not quantizers:
        raise RecipeError(
            KV_CACHE_FIELD,
            f"kv_cache is {args.kv_cache}, but no modifier of recipe.recipe quantizes (none has "
            "a `scheme` or `config_groups`), and the KV cache's scales are calibrated by one",
            "add a quantizing modifier to the recipe (e.g. QuantizationModifier with `scheme: "
            "FP8_DYNAMIC`), use a preset, or set recipe.kv_cache off",
        )
    for where, name, kwargs in quantizers:
        given = kwargs.get("kv_cache_scheme")
        kwargs["kv_cache_scheme"] = kv_cache_scheme(
            args, given, f"{RECIPE_FIELD} ({name} in {where})"
        )


def render(args: RecipeArgs) -> RenderedRecipe:
    """Every step, without Prefect or ClearML: what the task returns."""
    recipe, source, preset_name, values = fill(args)
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
    kv_cache = next(
        (m.kv_cache_scheme for m in modifiers if getattr(m, "kv_cache_scheme", None)), None
    )
    if args.pipeline in _EXPLICIT_PIPELINES:
        pipeline = args.pipeline
        if pipeline == "datafree" and needs_data:
            notes.append("pipeline datafree was asked for, but the modifiers need calibration data")
    else:  # as llmcompressor.pipelines.registry.CalibrationPipeline._infer_pipeline does
        pipeline = "sequential" if needs_data else "datafree"

    return RenderedRecipe(
        yaml=text,
        sha256=recipe_sha256(text),
        source=source,
        modifiers=[type(m).__name__ for m in modifiers],
        scheme=first_scheme(recipe) or preset_name,  # W4AFP8 is written out as config groups
        pipeline=pipeline,
        needs_data=needs_data,
        data_modifiers=sum(m.requires_calibration_data for m in modifiers),
        notes=notes,
        sequential_targets=sequential_targets,
        args=values,
        # As parsed, so a mapping with defaults left out reads as the scheme it is.
        kv_cache_scheme=kv_cache.model_dump(mode="json", include=set(KV_CACHE_FP8))
        if kv_cache
        else None,
    )
