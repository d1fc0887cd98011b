"""Step 1: a preset name, a .yaml file or YAML text becomes parsed recipe data."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml

from compressflow.errors import RecipeError
from compressflow.limits import load_yaml, not_regular, read_text
from compressflow.recipes import RECIPE_FIELD
from compressflow.registries.presets import PRESETS, preset_named

# A scheme named in a zoo stub (`.../quantization-w8a8-channelwise-dynamic`) -> its preset.
_ZOO_SCHEMES = {"w4a16": "W4A16", "w8a8": "W8A8", "fp8": "FP8_DYNAMIC"}


def _position(mark: yaml.Mark | None, prefix: str) -> str:
    return f"{prefix} line {mark.line + 1}, column {mark.column + 1}" if mark else ""


def _parse_yaml(text: str, where: str) -> Any:
    try:
        return load_yaml(text, where, RECIPE_FIELD, RecipeError)
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
        if not path.exists():
            raise RecipeError(
                RECIPE_FIELD,
                f"recipe file {recipe.strip()!r} does not exist (looked for {path.resolve()})",
                f"check the path; a relative path starts from the working directory {Path.cwd()}",
            )
        if not path.is_file():  # never opened: a FIFO's open blocks, a device never ends
            raise RecipeError(
                RECIPE_FIELD,
                f"recipe file {recipe.strip()!r} is not a regular file but {not_regular(path)} "
                f"(looked at {path.resolve()})",
                "name a .yaml file holding the recipe, or paste the recipe's YAML into recipe",
            )
        where = f"recipe file {str(path)!r}"
        data = _parse_yaml(read_text(path, where, RECIPE_FIELD, RecipeError), where)
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
