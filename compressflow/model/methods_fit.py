"""Whether the fetched model can take the recipe's structural methods, from config.json and the
safetensors headers (no torch, no weights): expert pruning (REAP) and rotations (QuIP).

llm-compressor checks both only once the model is loaded: REAP when it initializes ("Could not
find a config attribute for the number of experts", "sparsity ... results in 0 experts to
drop", "REAP sparsity is too aggressive"), QuIP when calibration starts ("128 must divide 96",
"Cannot construct deterministic hadamard of size != 2^n"). Here they are refused after fetch,
before the dataset builds, naming the field, the model's numbers and the fix.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from compressflow.errors import RecipeError
from compressflow.limits import read_json
from compressflow.model.headers import tensor_index
from compressflow.params import RecipeArgs
from compressflow.results import FetchedModel, RenderedRecipe

# llm-compressor 0.14's modifiers/pruning/reap/utils.py reads these config keys, in this order;
# DeepSeek-V3's config.json says n_routed_experts, which its config class maps num_local_experts to.
EXPERT_KEYS = ("num_experts", "num_local_experts", "moe_num_experts", "n_routed_experts")
TOP_K_KEYS = ("num_experts_per_tok", "top_k", "moe_top_k")
# REAP skips these families' experts (not LinearExperts2D) and then finds no MoE layer.
REAP_SKIPS = {"llama4": "Llama4's experts are not in the form REAP hooks (Llama4LinearExperts)"}


def _modifiers(recipe: RenderedRecipe, name: str) -> list[dict[str, Any]]:
    """The arguments of each `name` modifier of the rendered recipe."""
    data = yaml.safe_load(recipe.yaml) or {}
    return [
        kwargs or {}
        for stage in data.values()
        for group_key, group in stage.items()
        if group_key.endswith("_modifiers")
        for modifier, kwargs in group.items()
        if modifier == name
    ]


def _first(config: dict[str, Any], keys: tuple[str, ...]) -> tuple[str, Any] | None:
    return next(((key, config[key]) for key in keys if config.get(key) is not None), None)


def refuse_unfit_methods(recipe: RenderedRecipe, model: FetchedModel, asked: RecipeArgs) -> None:
    """Refuse expert pruning a model cannot take, and rotations its layers cannot take."""
    config_file = Path(model.path) / "config.json"
    config = read_json(config_file, "model.model_id") if config_file.is_file() else {}
    for kwargs in _modifiers(recipe, "REAPPruningModifier"):
        field = "recipe.prune_experts" if asked.prune_experts else recipe.given_in()
        refuse_unprunable(config, kwargs.get("sparsity"), field, model.model_id)
    for kwargs in _modifiers(recipe, "QuIPModifier"):
        refuse_unrotatable(Path(model.path), kwargs, recipe.given_in())


def refuse_unprunable(config: dict[str, Any], sparsity: Any, field: str, model_id: str) -> None:
    """REAP's own arithmetic (llm-compressor 0.14 REAPPruningModifier.on_initialize) on the
    model's config.json: the experts it has, the ones `sparsity` drops, the ones left to route."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    experts, top_k = _first(text, EXPERT_KEYS), _first(text, TOP_K_KEYS)
    if not isinstance(sparsity, (int, float)) or not 0 < sparsity < 1:
        return  # the recipe's validation refuses it, naming REAP's range
    if experts is None or not isinstance(experts[1], int) or experts[1] < 2:
        raise RecipeError(
            field,
            f"expert pruning (REAP, sparsity {sparsity}) needs a mixture-of-experts model, and "
            f"{model_id} ({config.get('model_type', 'no model_type')}) is dense: its config.json "
            f"has none of {', '.join(EXPERT_KEYS)}",
            "set recipe.prune_experts to 0 (or remove the recipe's REAPPruningModifier), or "
            "pick a mixture-of-experts model",
        )
    if why := REAP_SKIPS.get(str(text.get("model_type") or config.get("model_type"))):
        raise RecipeError(
            field,
            f"expert pruning (REAP) cannot prune {model_id}: {why}",
            "set recipe.prune_experts to 0, or remove the recipe's REAPPruningModifier",
        )
    key, count = experts
    k = top_k[1] if top_k and isinstance(top_k[1], int) else 1
    drop = int(count * sparsity)
    groups, top_groups = text.get("n_group"), text.get("topk_group", text.get("top_k_group"))
    if isinstance(groups, int) and isinstance(top_groups, int) and groups > 0:
        per_group = round(drop / groups)
        drop, left = per_group * groups, top_groups * (count // groups - per_group)
        where = f" ({groups} router groups of {count // groups}, the router picks {top_groups})"
    else:
        left, where = count - drop, ""
    if drop == 0 or k > left:
        problem = (
            f"drops no expert of {count} ({key}){where}"
            if drop == 0
            else f"leaves {left} expert(s) reachable of {count} ({key}){where}, fewer than the "
            f"{k} the router picks per token (num_experts_per_tok)"
        )
        raise RecipeError(
            field,
            f"expert pruning with sparsity {sparsity} on {model_id} {problem}",
            f"choose a fraction from {1 / count:.3g} (one expert) up to below "
            f"{(count - k + 1) / count:.3g} (keeps {k}), or 0 for no pruning",
        )


def _matches(name: str, pattern: str) -> bool:
    """compressed-tensors' match on a module name: `re:` regex from the start, else the name."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern


def refuse_unrotatable(folder: Path, kwargs: dict[str, Any], field: str) -> None:
    """QuIP's Hadamard needs, per rotated Linear layer, a block size dividing its input width
    (v rotations) or output width (u), and for the `hadamard` type a power-of-two size.

    Judged on the headers' 2-D weights when QuIP targets `Linear` (its default); other targets
    name classes only the built model knows, and a model fetched without weights has no headers.
    """
    targets = kwargs.get("targets", "Linear")
    if (targets if isinstance(targets, str) else tuple(targets)) not in ("Linear", ("Linear",)):
        return
    ignore = kwargs.get("ignore", "lm_head")
    ignore = [ignore] if isinstance(ignore, str) else list(ignore or [])
    block = kwargs.get("transform_block_size")
    kind = kwargs.get("transform_type", "random-hadamard")
    sides = {"v": 1, "u": 0}  # the rotated side's dimension in a (out, in) weight
    bad: list[str] = []
    for tensor, info in tensor_index(folder).items():
        module, _, leaf = tensor.rpartition(".")
        if leaf != "weight" or len(info.shape) != 2 or "embed" in module:
            continue
        if any(_matches(module, pattern) for pattern in ignore):
            continue
        for rotation in kwargs.get("rotations", ["v"]) or []:
            size = info.shape[sides.get(str(rotation).lower(), 1)]
            if block and size % block or not block and kind == "hadamard" and size & (size - 1):
                bad.append(f"{module} ({size})")
                break
    if not bad:
        return
    need = (
        f"a multiple of its Hadamard block, {block}"
        if block
        else "a power of two (a `hadamard` rotation of the whole width)"
    )
    raise RecipeError(
        field,
        f"QuIPModifier rotates {len(bad)} layer(s) whose width is not {need}: "
        f"{', '.join(bad[:6])}{' ...' if len(bad) > 6 else ''}; llm-compressor would fail only "
        "once the weights are loaded",
        "add those layers to the rotation's and the quantizer's `ignore` (a preset's: "
        "recipe_args `ignore`), or, in your own recipe, set transform_block_size to a power of "
        "two that divides every rotated width",
    )
