"""Mix precision: the precision each module can bear, for a size budget or a quality target.

Each quantizable module's held-out cost at each precision of the preset's family is measured
once, in one pass (`compressflow.evaluation.sensitivity`); the budget is solved from those
estimates (`compressflow.recipes.mixed`) and calibrated once, as one recipe with a config group
per precision. A bits budget (`target.avg_bits`) needs that one calibration. A ratio target
(`target.max_perplexity_ratio`) takes the fewest bits predicted to meet it; the estimate is
round-to-nearest's, and calibration does better, so the measured ratio rescales the estimate
and a second calibration tries the mix it then predicts: smaller when the first met the target
with room, larger when it missed. The smallest output that meets the target is published; none
meeting it raises TargetNotMet, and nothing is published. The trade-off the budget was chosen
from goes to the Prefect run (an artifact), ClearML (plots) and the manifest (for the card).
It is a target strategy (`MIX_PRECISION`: compressflow/runtime/strategies.py), chosen by
`compressflow.recipes.mixed.mixes`.
"""

from __future__ import annotations

import math
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from compressflow.evaluation.sensitivity import measure_sensitivity
from compressflow.inputs import Inputs
from compressflow.logs import run_logger
from compressflow.recipes.mixed import (
    Mix,
    chart_points,
    check_budget,
    describe_mix,
    family_of,
    frontier,
    mix_not_met,
    mixed_recipe,
    mixes,
    quantized_ignore,
    smallest_meeting,
    within_bits,
)
from compressflow.reporting import tracking
from compressflow.reporting.artifacts import artifact_key
from compressflow.reporting.tradeoff import tradeoff_markdown
from compressflow.results import (
    Calibration,
    FetchedModel,
    HeldOutText,
    MixedPrecision,
    MixPoint,
    RenderedRecipe,
    Sensitivity,
    TargetRound,
    TargetSearch,
)
from compressflow.runtime.isolation import in_child
from compressflow.runtime.strategies import Calibrating, Outcome, Strategy
from compressflow.store.staging import remove_staging

# The budgets the chart predicts beside the one asked for.
CHART_BUDGETS = [4.5, 5.0, 6.0, 8.0]


@task(name="measure sensitivity", cache_policy=NO_CACHE)
def measure(model: FetchedModel, held_out: HeldOutText, family: str, ignore: list[str]):
    """Every quantizable module's estimated held-out cost at each precision of `family`."""
    log = run_logger(__name__)
    sensitivity: Sensitivity = in_child(
        measure_sensitivity, model.path, model, held_out, family, ignore
    )
    log.info(
        "sensitivity: %d modules at %s, base perplexity %.4f on %d positions, %.1f s",
        len(sensitivity.modules),
        "/".join(sensitivity.modules[0].cost) if sensitivity.modules else "-",
        sensitivity.base_perplexity,
        sensitivity.positions,
        sensitivity.seconds,
    )
    return sensitivity


def mix_precision(calibrating: Calibrating) -> Outcome:
    """The published mix: its calibration, its recipe, and what was tried."""
    inputs, held_out = calibrating.inputs, calibrating.held_out
    recipe, model, target = inputs.recipe, inputs.model, inputs.args.target
    log = run_logger(__name__)
    family = family_of(recipe)
    sensitivity = calibrating.run(measure, model, held_out, family, quantized_ignore(recipe))
    budgets = sorted({*CHART_BUDGETS, *([target.avg_bits] if target.avg_bits else [])})
    path, base = frontier(sensitivity, tuple(budgets)), sensitivity.base_perplexity
    limit = target.max_perplexity_ratio
    affordable = (
        [m for m in path if m.avg_bits <= target.avg_bits + 1e-9] if target.avg_bits else path
    )
    first = within_bits(affordable, target.avg_bits) if target.avg_bits else None
    if limit:
        first = smallest_meeting(affordable, limit)
    search = TargetSearch(
        max_perplexity_ratio=limit,
        max_rounds=2,
        base_perplexity=base,
        held_out_source=held_out.source,
        held_out_samples=len(held_out.input_ids),
        excluded_calibration_samples=held_out.excluded_calibration_samples,
        ranked_modules=len(sensitivity.modules),
        rounds=[],
        avg_bits=target.avg_bits,
    )
    outputs: dict[int, tuple[Calibration, RenderedRecipe, Mix]] = {}

    def calibrate_and_measure(mix: Mix) -> TargetRound:
        mixed = mixed_recipe(recipe, mix)
        calibration = calibrating.calibrate(mixed)
        measured = calibrating.perplexity(calibration.staging_path)
        result = TargetRound(
            round=len(search.rounds) + 1,
            unquantized=[n for n, p in mix.precisions.items() if p == "16-bit"],
            perplexity=measured,
            ratio=measured / base,
            size_bytes=calibration.checkpoint_bytes,
            met=not limit or measured / base <= limit,
            avg_bits=round(mix.avg_bits, 4),
            predicted_ratio=mix.predicted_ratio(),
        )
        search.rounds.append(result)
        outputs[result.round] = (calibration, mixed, mix)
        log.info("target: %s", describe_mix(result, mix, limit))
        return result

    result = calibrate_and_measure(first)
    if limit and first.predicted_log_ratio > 0:
        # Calibration's gain over round-to-nearest, as a factor on the log ratio.
        scale = math.log(max(result.ratio, 1.0)) / first.predicted_log_ratio
        second = smallest_meeting(affordable, limit, scale * 1.05 if result.met else scale)
        smaller = result.met and second.avg_bits < first.avg_bits
        larger = not result.met and second.avg_bits > first.avg_bits
        if smaller or larger:
            calibrate_and_measure(second)
    met = [r for r in search.rounds if r.met]
    chosen = min(met, key=lambda r: (r.avg_bits, r.ratio)) if met else None
    for r in search.rounds:
        if chosen is None or r.round != chosen.round:
            remove_staging(Path(outputs[r.round][0].staging_path))
    points = chart_points(sensitivity, path, search.rounds, budgets)
    if chosen is not None:
        search.chosen_round = chosen.round
        search.mix = MixedPrecision(
            family=family,
            precisions=outputs[chosen.round][2].precisions,
            avg_bits=chosen.avg_bits,
            sensitivity_seconds=sensitivity.seconds,
            points=points,
            sensitivity=sensitivity.modules,
        )
    tracking.log_result(search)
    publish_tradeoff(inputs, search, points)
    if chosen is None:
        raise mix_not_met(search)
    calibration, mixed, _ = outputs[chosen.round]
    return calibration, mixed, search


def publish_tradeoff(inputs: Inputs, search: TargetSearch, points: list[MixPoint]) -> None:
    """The chart and per-module map on the Prefect run, as an artifact a person reads at a glance."""
    create_markdown_artifact(
        key=artifact_key(inputs.args.model.model_id, inputs.recipe.source, "tradeoff"),
        markdown=tradeoff_markdown(search, points),
        description="Size against held-out perplexity: what the budget was chosen from",
    )


# flows/strategies.py lists it.
MIX_PRECISION = Strategy(name="mix precision", applies=mixes, run=mix_precision, check=check_budget)
