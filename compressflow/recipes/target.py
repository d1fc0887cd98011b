"""Compress to a target, the recipe side: which modules a round leaves unquantized, and the recipe
that leaves them.

Modules are ranked by the per-module error GPTQ reports at calibration (`Calibration.modules`),
largest first; a round leaves the first 1, 2, 4, ... of them unquantized, by their exact names in
the quantizing modifiers' `ignore` lists, until one round meets the target, then bisects between
the last miss and the first hit (`next_count`). The search loop is the search target stage
(tasks/search_target.py).
"""

from __future__ import annotations

import yaml

from compressflow.errors import InputError, TargetNotMet
from compressflow.params import MAX_TARGET_ROUNDS, TargetArgs
from compressflow.recipes.tree import add_ignore, dump_recipe, iter_modifiers, quantizes
from compressflow.results import Calibration, RenderedRecipe, TargetRound, TargetSearch
from compressflow.store.identity import recipe_sha256

FIELD = "target.max_perplexity_ratio"
# The modifier whose per-module error ranks the modules (tasks/calibrate.py's sink
# reads it from llm-compressor's log lines; no other modifier reports one per module).
RANKING_MODIFIER = "GPTQModifier"


def check_searchable(recipe: RenderedRecipe, target: TargetArgs) -> None:
    """Refuse, before anything loads, a target on a recipe whose calibration ranks no module."""
    if not target.max_perplexity_ratio:
        return
    data = yaml.safe_load(recipe.yaml)
    quantizing = [name for _, name, kwargs in iter_modifiers(data) if quantizes(kwargs)]
    if RANKING_MODIFIER in recipe.modifiers and quantizing:
        return
    what = ", ".join(recipe.modifiers) or "no modifier"
    raise InputError(
        FIELD,
        f"the recipe ({recipe.source}: {what}) has no {RANKING_MODIFIER}, so calibration measures "
        "no per-module error to choose which modules to leave unquantized"
        if RANKING_MODIFIER not in recipe.modifiers
        else f"the recipe ({recipe.source}: {what}) has no modifier with a scheme or config "
        "groups, whose ignore list could leave modules unquantized",
        "use a GPTQ recipe or preset (W4A16, W8A8, W4A8, ...), or set "
        "target.max_perplexity_ratio to 0 to compress without a target",
    )


def ranked_modules(calibration: Calibration) -> list[str]:
    """Module names by GPTQ error, largest first (ties in calibration order)."""
    measured = [m for m in calibration.modules if m.error is not None]
    return [m.name for m in sorted(measured, key=lambda m: -m.error)]


def next_count(tried: list[tuple[int, bool]], candidates: int) -> int | None:
    """How many of the ranked modules the next round leaves unquantized; None: the search is over.

    `tried` holds (modules unquantized, target met) per round, round 1 (0 modules) first. Until a
    round meets the target the count doubles (1, 2, 4, ..., at most `candidates`); after, it
    bisects between the largest miss below the smallest hit and that hit.
    """
    hits = [n for n, met in tried if met]
    misses = [n for n, met in tried if not met]
    if not misses:
        return None  # the recipe as asked met it
    if not hits:
        largest = max(misses)
        return None if largest >= candidates else min(candidates, max(1, 2 * largest))
    hit = min(hits)
    miss = max((n for n in misses if n < hit), default=0)
    middle = (miss + hit) // 2
    return middle if middle > miss else None


def with_unquantized(recipe: RenderedRecipe, modules: list[str]) -> RenderedRecipe:
    """`recipe` with `modules` (exact names) added to every quantizing modifier's ignore list."""
    if not modules:
        return recipe
    data = yaml.safe_load(recipe.yaml)
    changed = [
        name
        for _, name, kwargs in iter_modifiers(data)
        if quantizes(kwargs) and add_ignore(kwargs, modules)
    ]
    text = dump_recipe(data)
    note = (
        f"compress to target: {', '.join(changed)} leave {len(modules)} module(s) with the "
        f"largest GPTQ error unquantized: {', '.join(modules)}"
    )
    return recipe.model_copy(
        update={
            "yaml": text,
            "sha256": recipe_sha256(text),
            "notes": [*recipe.notes, note],
        }
    )


def describe(r: TargetRound, target: float) -> str:
    names = f" ({', '.join(r.unquantized)})" if r.unquantized else ""
    return (
        f"round {r.round}: {len(r.unquantized)} module(s) unquantized{names}, perplexity "
        f"{r.perplexity:.4f}, ratio {r.ratio:.4f} (target {target}) "
        f"{'met' if r.met else 'missed'}, {r.size_bytes / 1e6:.1f} MB"
    )


def not_met(search: TargetSearch, limit: float, candidates: int) -> TargetNotMet:
    best, first = search.best(), search.rounds[0]
    rounds = len(search.rounds)
    if not candidates:
        problem = (
            f"the recipe as asked reached a perplexity ratio of {first.ratio:.4f}, over the "
            f"target {limit}, and calibration reported no per-module GPTQ error to choose "
            "modules to leave unquantized by; nothing was published"
        )
    else:
        every = (
            f"; leaving all {candidates} modules GPTQ calibrated unquantized did not meet it"
            if any(len(r.unquantized) >= candidates for r in search.rounds)
            else ""
        )
        problem = (
            f"no configuration met the perplexity ratio {limit} in {rounds} round(s){every}: "
            f"the best, round {best.round} with {len(best.unquantized)} of {candidates} "
            f"modules unquantized, reached {best.ratio:.4f} (the recipe as asked: "
            f"{first.ratio:.4f}); nothing was published"
        )
    rounds_fix = (
        f"raise target.max_rounds (now {search.max_rounds}, at most {MAX_TARGET_ROUNDS}), "
        if search.max_rounds < MAX_TARGET_ROUNDS and candidates
        else ""
    )
    return TargetNotMet(
        FIELD,
        problem,
        f"{rounds_fix}loosen target.max_perplexity_ratio (to {best.ratio:.4f} or more), or use "
        "a scheme with more bits (e.g. W8A8 instead of W4A16)",
    )
