"""Walking and writing a recipe as llm-compressor's YAML shape: stages -> modifier groups -> modifiers.

Shared by the stages that build a recipe (render), tailor it to an architecture (adapt) and leave
modules unquantized to meet a quality target (search target).
"""

from __future__ import annotations

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


def quantizes(kwargs: dict[str, Any]) -> bool:
    """Whether a modifier quantizes (it has a scheme or config groups): one an ignore list binds."""
    return "scheme" in kwargs or "config_groups" in kwargs


def add_ignore(kwargs: dict[str, Any], patterns: list[str]) -> list[str]:
    """Append to a modifier's `ignore` the `patterns` it lacks, in order; return those added.

    An ignore entry is an exact module name, or a regex after `re:` (compressed-tensors'
    matching); a single string is kept as the list's first entry.
    """
    ignore = kwargs.get("ignore") or []
    ignore = [ignore] if isinstance(ignore, str) else list(ignore)
    added = [p for i, p in enumerate(patterns) if p not in ignore and p not in patterns[:i]]
    if added:
        kwargs["ignore"] = [*ignore, *added]
    return added


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
