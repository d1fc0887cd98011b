"""Search target: the smallest configuration whose held-out perplexity meets `target`.

Compress to a target ("the smallest model that keeps 99%") works on what calibration already
measures: GPTQ's per-module error (`Calibration.modules`). Round 1 is the recipe as asked. When its
held-out perplexity over the base model's is above `target.max_perplexity_ratio`, each later round
leaves more of the modules with the largest round-1 error unquantized (which ones, how many, and
the recipe that leaves them: `compressflow.recipes.target`), so the published set is the smallest
one found in `target.max_rounds` calibrations. Every round is a full calibration by the calibrate
stage, run through the `Calibrating` the flow gives every target strategy (stages never import one
another: compressflow/runtime/strategies.py); the outputs that lose are deleted as soon as a
better one is known. A search that ends without a hit raises TargetNotMet,
and the flow publishes nothing. Perplexity is `compressflow.evaluation.quality`'s.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from compressflow.evaluation.quality import perplexity_of
from compressflow.logs import run_logger
from compressflow.params import TargetArgs
from compressflow.recipes.mixed import mixes
from compressflow.recipes.target import (
    check_searchable,
    describe,
    next_count,
    not_met,
    ranked_modules,
    with_unquantized,
)
from compressflow.reporting import tracking
from compressflow.results import (
    Calibration,
    FetchedModel,
    HeldOutText,
    RenderedRecipe,
    TargetRound,
    TargetSearch,
)
from compressflow.runtime.isolation import in_child
from compressflow.runtime.strategies import Calibrating, Outcome, Strategy
from compressflow.store.staging import remove_staging


@task(name="measure perplexity", cache_policy=NO_CACHE)
def measure_perplexity(path: str, model: FetchedModel, held_out: HeldOutText) -> float:
    """Held-out perplexity of the checkpoint at `path` (the base, or a round's staged output)."""
    return in_child(perplexity_of, path, model, held_out)


def search_target(calibrating: Calibrating) -> Outcome:
    """The round that meets the target with the fewest modules unquantized: its calibration,
    its recipe, and what every round measured. Round 1 is the recipe as asked. Outputs that
    lose are deleted; TargetNotMet when no round met the target, with every output deleted."""
    inputs, held_out = calibrating.inputs, calibrating.held_out
    recipe, model, target = inputs.recipe, inputs.model, inputs.args.target
    first = calibrating.calibrate(recipe)
    log = run_logger(__name__)
    limit = target.max_perplexity_ratio
    base = calibrating.perplexity(model.path)
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
        measured = calibrating.perplexity(calibration.staging_path)
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
        calibration = calibrating.calibrate(tried_recipe)
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


def searches(recipe: RenderedRecipe, target: TargetArgs) -> bool:
    """A target that mixing precisions does not take: a ratio, met by leaving modules out."""
    return target.wanted() and not mixes(recipe, target)


# flows/strategies.py lists it.
SEARCH_TARGET = Strategy(
    name="search target", applies=searches, run=search_target, check=check_searchable
)
