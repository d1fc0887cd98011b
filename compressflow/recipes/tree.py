"""Walking and writing a recipe as llm-compressor's YAML shape: stages -> modifier groups -> modifiers.

Shared by the stages that build a recipe (render) and tailor it to an architecture (adapt).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from typing import Any

import yaml


def iter_modifiers(recipe: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(location, modifier name, kwargs) for each modifier, in recipe order."""
    for stage_key, stage in recipe.items():
        for group_key, group in stage.items():
            if group_key.endswith("_modifiers"):
                for name, kwargs in group.items():
                    yield f"{stage_key}.{group_key}", name, kwargs


class _CanonicalDumper(yaml.SafeDumper):
    """Writes repeated values in full: `&id001` anchors would puzzle readers of recipe.yaml."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_recipe(recipe: dict[str, Any]) -> str:
    return yaml.dump(recipe, Dumper=_CanonicalDumper, sort_keys=False, allow_unicode=True)


def first_scheme(recipe: dict[str, Any]) -> str | None:
    for _, _, kwargs in iter_modifiers(recipe):
        scheme = kwargs.get("scheme")
        if isinstance(scheme, str):
            return scheme
        if isinstance(scheme, dict) and scheme:  # {W4A16: [Linear], ...}: scheme -> targets
            return "+".join(map(str, scheme))
    return None


def closest(word: str, choices: list[str], cutoff: float = 0.5) -> str:
    """A "did you mean ...? " hint for a misspelt name, or "" when nothing is close."""
    close = difflib.get_close_matches(word, choices, n=3, cutoff=cutoff)
    return f"did you mean {' or '.join(close)}? " if close else ""
