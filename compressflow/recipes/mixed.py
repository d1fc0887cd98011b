"""Mixed precision to a budget, the recipe side: which precision each module gets, and the recipe.

From the measured sensitivities (`Sensitivity`: each module's estimated held-out cost at each
precision of its family), modules are grouped into units that vLLM serves as one layer
(`registries.precisions.FUSED`), and the budget is a multiple-choice knapsack over the units:
the smallest summed cost for at most `avg_bits` bits per quantizable weight, or the fewest bits
whose predicted perplexity ratio meets a target. It is solved exactly, by dynamic programming
over the bits (`frontier`), which gives the best mix at every size at once: the trade-off curve
the run publishes. (A greedy on cost saved per bit stops at the first upgrade that does not fit;
with int4 groups of 32 and 64 beside int8, it left 0.12 of 4.5 bits unspent on the yardstick.) The chosen mix becomes one recipe: the preset's quantizing modifier with one
config group per precision naming its modules, and the 16-bit ones in its ignore list.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import yaml

from compressflow.errors import InputError, TargetNotMet
from compressflow.params import TargetArgs
from compressflow.recipes.tree import add_ignore, dump_recipe, iter_modifiers, quantizes
from compressflow.registries.precisions import EXPERTS, FAMILIES, FUSED, MIXABLE, Precision
from compressflow.results import (
    MixPoint,
    RenderedRecipe,
    Sensitivity,
    TargetRound,
    TargetSearch,
)
from compressflow.store.identity import recipe_sha256

BITS_FIELD = "target.avg_bits"
RATIO_FIELD = "target.max_perplexity_ratio"
_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


def family_of(recipe: RenderedRecipe) -> str | None:
    """The precision family of a preset a budget can mix; None for any other recipe."""
    preset = recipe.source.removeprefix("preset:")
    return MIXABLE.get(preset) if recipe.source.startswith("preset:") else None


def mixes(recipe: RenderedRecipe, target: TargetArgs) -> bool:
    """Whether this run's target is met by mixing precisions (rather than by leaving the worst
    modules unquantized, round after round)."""
    if target.avg_bits:
        return True
    if not target.max_perplexity_ratio or target.method == "leave_unquantized":
        return False
    return target.method == "mixed_precision" or family_of(recipe) is not None


def check_budget(recipe: RenderedRecipe, target: TargetArgs) -> None:
    """Refuse, before anything loads, a budget the recipe cannot mix or its family cannot reach."""
    if not mixes(recipe, target):
        return
    family = family_of(recipe)
    field = BITS_FIELD if target.avg_bits else "target.method"
    if family is None:
        raise InputError(
            field,
            f"mixed precision needs a preset whose precision family is known; the recipe is "
            f"{recipe.source}",
            f"use the preset {' or '.join(MIXABLE)} (recipe.preset, with recipe.recipe empty), "
            "or, for a ratio target on your own GPTQ recipe, set target.method to "
            "leave_unquantized",
        )
    fewest = FAMILIES[family][0]
    if target.avg_bits and target.avg_bits < fewest.bits:
        raise InputError(
            BITS_FIELD,
            f"{target.avg_bits} bits per weight is below what the {family} family reaches: its "
            f"fewest, {fewest.name} ({fewest.scheme}), takes {fewest.bits:g} with its scales",
            f"give at least {fewest.bits:g} (every module at {fewest.name}), or use "
            f"{recipe.source.removeprefix('preset:')} without a budget",
        )


def unit_of(name: str) -> str:
    """The unit a module takes its precision with: the vLLM layer it is fused into."""
    if EXPERTS in name:
        return name.split(EXPERTS, 1)[0] + EXPERTS + "*"
    parent, _, leaf = name.rpartition(".")
    for fused in FUSED:
        if leaf in fused:
            return f"{parent}.{'+'.join(fused)}"
    return name


# The knapsack's resolution: steps between all at the fewest bits and all in 16; and how many
# evenly spaced sizes the curve is read at (besides each budget asked for).
STEPS = 4096
GRID = 128


@dataclass
class _Unit:
    modules: list[str]
    options: list[tuple[Precision, float, float]]  # precision, bits, cost; fewest bits first


def _bits(precision: Precision, weights: int, in_features: int) -> float:
    return weights * (precision.bits + (16 / in_features if precision.per_channel else 0))


def _units(sensitivity: Sensitivity) -> list[_Unit]:
    grouped: dict[str, list] = {}
    for module in sensitivity.modules:
        grouped.setdefault(unit_of(module.name), []).append(module)
    units = []
    for members in grouped.values():
        options = [
            (
                p,
                sum(_bits(p, m.weights, m.in_features) for m in members),
                sum(m.cost[p.name] for m in members),
            )
            for p in FAMILIES[sensitivity.family]
        ]
        units.append(_Unit([m.name for m in members], options))
    return units


def _hull(options: list[tuple[Precision, float, float]]) -> list[int]:
    """Indices of the lower convex hull of (bits, cost), fewest bits first: the upgrades worth
    taking in order (one that saves less per bit than a later one is skipped over)."""
    hull: list[int] = []
    for i, (_, bits, cost) in enumerate(options):
        if hull and cost >= options[hull[-1]][2]:
            continue  # more bits for no less cost
        while len(hull) >= 2:
            (_, b1, c1), (_, b2, c2) = options[hull[-2]], options[hull[-1]]
            if (c1 - c2) / (b2 - b1) <= (c2 - cost) / (bits - b2):
                hull.pop()
            else:
                break
        hull.append(i)
    return hull


@dataclass(frozen=True)
class Mix:
    """One assignment: each module's precision, its bits per weight and predicted ratio."""

    precisions: dict[str, str]
    avg_bits: float
    predicted_log_ratio: float

    def predicted_ratio(self, scale: float = 1.0) -> float:
        return math.exp(scale * self.predicted_log_ratio)

    def counts(self) -> dict[str, int]:
        counted: dict[str, int] = {}
        for precision in self.precisions.values():
            counted[precision] = counted.get(precision, 0) + 1
        return counted


def frontier(sensitivity: Sensitivity, budgets: tuple[float, ...] = ()) -> list[Mix]:
    """The best mix (lowest predicted cost) at `GRID` sizes from all at the fewest bits to all in
    16, and at each of `budgets` (bits per weight), fewest bits first, each with less cost than
    every smaller one: the trade-off curve the budget is read from.

    An exact multiple-choice knapsack by dynamic programming over the bits above each unit's
    fewest, in `STEPS` steps, every option's bits rounded up to a step: a mix never takes more
    bits than its budget allows."""
    import numpy as np

    units = _units(sensitivity)
    total = sum(m.weights for m in sensitivity.modules)
    floor = sum(min(bits for _, bits, _ in u.options) for u in units)
    step = (sum(max(bits for _, bits, _ in u.options) for u in units) - floor) / STEPS
    # Steps each option takes above its unit's fewest bits, rounded up.
    needs = [
        [
            math.ceil((bits - min(b for _, b, _ in u.options)) / step - 1e-9)
            for _, bits, _ in u.options
        ]
        for u in units
    ]
    top = sum(max(need) for need in needs)  # all in 16 bits, after the rounding
    best = np.zeros(top + 1)  # lowest cost within c steps, over the units so far
    choices = []
    for unit, need in zip(units, needs, strict=True):
        after = np.full(top + 1, np.inf)
        choice = np.zeros(top + 1, dtype=np.int8)
        for index, (_, _, cost) in enumerate(unit.options):
            candidate = np.full(top + 1, np.inf)
            candidate[need[index] :] = best[: top + 1 - need[index]] + cost
            better = candidate < after
            after[better], choice[better] = candidate[better], index
        best = after
        choices.append(choice)

    def mix_at(capacity: int) -> Mix:
        picked = []
        for unit, need, choice in zip(units[::-1], needs[::-1], choices[::-1], strict=True):
            index = choice[capacity]
            capacity -= need[index]
            picked.append((unit, unit.options[index]))
        picked.reverse()  # the model's order, as the map and the manifest list them
        return Mix(
            precisions={n: p.name for unit, (p, _, _) in picked for n in unit.modules},
            avg_bits=sum(bits for _, (_, bits, _) in picked) / total,
            predicted_log_ratio=sum(cost for _, (_, _, cost) in picked),
        )

    wanted = {round(i * top / GRID) for i in range(GRID + 1)}
    wanted |= {max(0, min(top, math.floor((b * total - floor) / step))) for b in budgets}
    found = {(m.avg_bits, m.predicted_log_ratio): m for m in map(mix_at, sorted(wanted))}
    curve: list[Mix] = []
    for _, mix in sorted(found.items()):
        if not curve or mix.predicted_log_ratio < curve[-1].predicted_log_ratio:
            curve.append(mix)
    return curve


def within_bits(path: list[Mix], avg_bits: float) -> Mix:
    """The lowest predicted cost at most `avg_bits` per weight."""
    return min((m for m in path if m.avg_bits <= avg_bits + 1e-9), key=_cost_then_bits)


def smallest_meeting(path: list[Mix], ratio: float, scale: float = 1.0) -> Mix:
    """The fewest bits whose predicted ratio (its log scaled by `scale`) is at most `ratio`;
    all 16-bit when none is."""
    meeting = [m for m in path if m.predicted_ratio(scale) <= ratio]
    return min(meeting, key=lambda m: m.avg_bits) if meeting else path[-1]


def _cost_then_bits(mix: Mix) -> tuple[float, float]:
    return mix.predicted_log_ratio, mix.avg_bits


def uniform(sensitivity: Sensitivity, precision: Precision) -> Mix:
    """Every module at `precision`: a uniform preset, as the sensitivities predict it."""
    modules = sensitivity.modules
    return Mix(
        precisions={m.name: precision.name for m in modules},
        avg_bits=sum(_bits(precision, m.weights, m.in_features) for m in modules)
        / sum(m.weights for m in modules),
        predicted_log_ratio=sum(m.cost[precision.name] for m in modules),
    )


def chart_points(
    sensitivity: Sensitivity, path: list[Mix], rounds: list[TargetRound], budgets: list[float]
) -> list[MixPoint]:
    """The trade-off chart's points: the base; each uniform precision and the best mix at each
    budget, as predicted; and each calibrated round, as measured."""
    base = sensitivity.base_perplexity
    points = [MixPoint(label="base model", avg_bits=16.0, perplexity=base, measured=True)]
    for precision in FAMILIES[sensitivity.family][:-1]:
        everywhere = uniform(sensitivity, precision)
        points.append(
            MixPoint(
                label=f"{precision.name} everywhere (round-to-nearest)",
                avg_bits=everywhere.avg_bits,
                perplexity=base * everywhere.predicted_ratio(),
                measured=False,
            )
        )
    for budget in budgets:
        best = within_bits(path, budget)
        points.append(
            MixPoint(
                label=f"mix at {budget:g} bits (predicted)",
                avg_bits=best.avg_bits,
                perplexity=base * best.predicted_ratio(),
                measured=False,
            )
        )
    points += [
        MixPoint(
            label=f"round {r.round}: mix at {r.avg_bits:.3f} bits (calibrated)",
            avg_bits=r.avg_bits,
            perplexity=r.perplexity,
            measured=True,
        )
        for r in rounds
    ]
    return points


def describe_mix(r: TargetRound, mix: Mix, limit: float) -> str:
    counts = ", ".join(f"{n} {p}" for p, n in mix.counts().items())
    verdict = f" (target {limit}) {'met' if r.met else 'missed'}" if limit else ""
    return (
        f"round {r.round}: mixed precision {counts}, {r.avg_bits:.3f} bits per weight, "
        f"perplexity {r.perplexity:.4f}, ratio {r.ratio:.4f}, predicted {r.predicted_ratio:.4f}"
        f"{verdict}, {r.size_bytes / 1e6:.1f} MB"
    )


def quantized_ignore(recipe: RenderedRecipe) -> list[str]:
    """The ignore list of the recipe's quantizing modifier: what no precision is chosen for."""
    for _, _, kwargs in iter_modifiers(yaml.safe_load(recipe.yaml)):
        if quantizes(kwargs):
            ignore = kwargs.get("ignore") or []
            return [ignore] if isinstance(ignore, str) else list(ignore)
    return []


def mix_not_met(search: TargetSearch) -> TargetNotMet:
    """No mix within the budget met the ratio: what the closest reached, and what to change."""
    best = search.best()
    budget = f" within {search.avg_bits:g} bits per weight" if search.avg_bits else ""
    return TargetNotMet(
        RATIO_FIELD,
        f"no mixed-precision assignment{budget} met the perplexity ratio "
        f"{search.max_perplexity_ratio} in {len(search.rounds)} calibration(s): the closest, "
        f"round {best.round} at {best.avg_bits:.3f} bits per weight, reached {best.ratio:.4f} "
        f"(predicted {best.predicted_ratio:.4f}); nothing was published",
        f"loosen target.max_perplexity_ratio (to {best.ratio:.4f} or more)"
        + (", or raise target.avg_bits" if search.avg_bits else ", or use a gentler preset"),
    )


def mixed_recipe(recipe: RenderedRecipe, mix: Mix) -> RenderedRecipe:
    """`recipe` (a mixable preset) with its quantizing modifier's scheme replaced by one config
    group per precision in `mix`, naming its modules, and the 16-bit modules ignored."""
    from compressed_tensors.quantization import preset_name_to_scheme

    family = FAMILIES[family_of(recipe)]
    data = yaml.safe_load(recipe.yaml)
    by_precision: dict[str, list[str]] = {}
    for name, precision in mix.precisions.items():
        by_precision.setdefault(precision, []).append(name)
    for _, _, kwargs in iter_modifiers(data):
        if not quantizes(kwargs):
            continue
        kwargs.pop("scheme", None)
        groups = {}
        for precision in family:
            if precision.scheme and (names := by_precision.get(precision.name)):
                scheme = preset_name_to_scheme(precision.scheme, names)
                if precision.group_size:
                    scheme.weights = scheme.weights.model_copy(
                        update={"group_size": precision.group_size}
                    )
                groups[f"group_{precision.name}"] = scheme.model_dump(
                    mode="json", exclude_none=True
                ) | {"targets": names}
        kwargs["config_groups"] = groups
        add_ignore(kwargs, by_precision.get("16-bit", []))
    text = dump_recipe(data)
    counts = ", ".join(f"{n} {p}" for p, n in mix.counts().items())
    note = f"mixed precision: {counts} module(s), {mix.avg_bits:.3f} bits per weight"
    return recipe.model_copy(
        update={
            "yaml": text,
            "sha256": recipe_sha256(text),
            "notes": [*recipe.notes, note],
        }
    )
