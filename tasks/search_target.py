"""Search target: the smallest configuration whose held-out perplexity meets `target`.

Compress to a target ("the smallest model that keeps 99%") works on what calibration already
measures: GPTQ's per-module error (`Calibration.modules`). Round 1 is the recipe as asked. When its
held-out perplexity over the base model's is above `target.max_perplexity_ratio`, each later round
leaves the modules with the largest round-1 error unquantized, by their exact names in the
quantization modifiers' `ignore` lists: 1, 2, 4, ... of them until one round meets the target,
then bisecting between the last miss and the first hit (`next_count`), so the published set is
the smallest one found in `target.max_rounds` calibrations. Every round is a full calibration by
the calibrate stage, which the flow hands in (stages never import one another); the outputs that
lose are deleted as soon as a better one is known. A search that ends without a hit raises
TargetNotMet, and the flow publishes nothing.
"""

from __future__ import annotations

import gc
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from prefect import task
from prefect.cache_policies import NO_CACHE

from compressflow.errors import InputError, TargetNotMet
from compressflow.logs import run_logger
from compressflow.params import MAX_TARGET_ROUNDS, TargetArgs
from compressflow.recipes.tree import add_ignore, dump_recipe, iter_modifiers, quantizes
from compressflow.reporting import tracking
from compressflow.reporting.quality import load_causal_lm, perplexity
from compressflow.results import (
    Calibration,
    FetchedModel,
    HeldOutText,
    RenderedRecipe,
    TargetRound,
    TargetSearch,
)
from compressflow.runtime.isolation import in_child
from compressflow.store.manifest import remove_staging

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
            "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
            "notes": [*recipe.notes, note],
        }
    )


@task(name="measure perplexity", cache_policy=NO_CACHE)
def measure_perplexity(path: str, model: FetchedModel, held_out: HeldOutText) -> float:
    """Held-out perplexity of the checkpoint at `path` (the base, or a round's staged output)."""
    return in_child(perplexity_of, path, model, held_out)


def perplexity_of(path: str, model: FetchedModel, held_out: HeldOutText) -> float:
    loaded = load_causal_lm(path, model.model_class, model.trust_remote_code)
    try:
        return perplexity(loaded, held_out.input_ids)
    finally:
        del loaded
        gc.collect()


def describe(r: TargetRound, target: float) -> str:
    names = f" ({', '.join(r.unquantized)})" if r.unquantized else ""
    return (
        f"round {r.round}: {len(r.unquantized)} module(s) unquantized{names}, perplexity "
        f"{r.perplexity:.4f}, ratio {r.ratio:.4f} (target {target}) "
        f"{'met' if r.met else 'missed'}, {r.size_bytes / 1e6:.1f} MB"
    )


def search_target(
    run: Callable[..., Any],
    first: Calibration,
    recipe: RenderedRecipe,
    model: FetchedModel,
    held_out: HeldOutText,
    target: TargetArgs,
    recalibrate: Callable[[RenderedRecipe], Calibration],
) -> tuple[Calibration, RenderedRecipe, TargetSearch]:
    """The round that meets the target with the fewest modules unquantized: its calibration,
    its recipe, and what every round measured. `first` is round 1 (the recipe as asked);
    `recalibrate(recipe)` runs one more calibration into a staging folder of its own; `run`
    runs a stage (the flow's `Stages.run`). Outputs that lose are deleted; TargetNotMet when
    no round met the target, with every output deleted."""
    log = run_logger(__name__)
    limit = target.max_perplexity_ratio
    base = run(measure_perplexity, model.path, model, held_out)
    log.info(
        "target: base model perplexity %.4f on %d held-out texts from %s; target ratio %s",
        base,
        len(held_out.input_ids),
        held_out.source,
        limit,
    )
    ranked = ranked_modules(first)
    search = TargetSearch(
        max_perplexity_ratio=limit,
        max_rounds=target.max_rounds,
        base_perplexity=base,
        held_out_source=held_out.source,
        held_out_samples=len(held_out.input_ids),
        excluded_calibration_samples=held_out.excluded_calibration_samples,
        ranked_modules=len(ranked),
        rounds=[],
    )
    best: tuple[Calibration, RenderedRecipe] | None = None
    calibration, tried_recipe, count = first, recipe, 0
    while True:
        measured = run(measure_perplexity, calibration.staging_path, model, held_out)
        result = TargetRound(
            round=len(search.rounds) + 1,
            unquantized=ranked[:count],
            perplexity=measured,
            ratio=measured / base,
            size_bytes=calibration.checkpoint_bytes,
            met=measured / base <= limit,
        )
        search.rounds.append(result)
        log.info("target: %s", describe(result, limit))
        if result.met and (best is None or count < len(search.chosen().unquantized)):
            if best is not None:
                remove_staging(Path(best[0].staging_path))
            best, search.chosen_round = (calibration, tried_recipe), result.round
        else:
            remove_staging(Path(calibration.staging_path))
        tried = [(len(r.unquantized), r.met) for r in search.rounds]
        count = next_count(tried, len(ranked))
        if count is None or len(search.rounds) >= target.max_rounds:
            break
        tried_recipe = with_unquantized(recipe, ranked[:count])
        calibration = recalibrate(tried_recipe)
    tracking.log_result(search)
    if best is None:
        raise not_met(search, limit, len(ranked))
    chosen = search.chosen()
    log.info(
        "target: met in round %d with %d module(s) unquantized, ratio %.4f (target %s); "
        "%+.1f MB against the recipe as asked (%.1f MB)",
        chosen.round,
        len(chosen.unquantized),
        chosen.ratio,
        limit,
        search.size_cost_bytes() / 1e6,
        search.rounds[0].size_bytes / 1e6,
    )
    return best[0], best[1], search


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
