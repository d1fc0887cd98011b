"""Mixed precision to a budget, its parts without a flow: the knapsack over measured
sensitivities, the units vLLM fuses, the recipe with a config group per precision, the budget
refusals, and the sensitivity pass on the tiny model.

End to end on the learned-weights yardstick: tests/matrix/test_mixed_precision_yardstick.py.
"""

from __future__ import annotations

import itertools
import random

import pytest
import yaml
from support.recipes import quantizing_modifiers

from compressflow.errors import InputError
from compressflow.params import RecipeArgs, TargetArgs
from compressflow.recipes.mixed import (
    STEPS,
    check_budget,
    frontier,
    mixed_recipe,
    mixes,
    unit_of,
    within_bits,
)
from compressflow.recipes.render import render
from compressflow.registries.precisions import FAMILIES
from compressflow.results import ModuleSensitivity, Sensitivity

LEAVES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def sensitivity(layers: int, seed: int, family: str = "int") -> Sensitivity:
    rng = random.Random(seed)
    modules = []
    for layer, leaf in itertools.product(range(layers), LEAVES):
        int4 = rng.random() * (3 if layer == 0 else 1) * 1e-3
        mlp = leaf in ("gate_proj", "up_proj", "down_proj")
        names = [p.name for p in FAMILIES[family]]
        modules.append(
            ModuleSensitivity(
                name=f"model.layers.{layer}.{'mlp' if mlp else 'self_attn'}.{leaf}",
                weights=128 * (384 if mlp else 128),
                in_features=384 if leaf == "down_proj" else 128,
                # Smaller groups cut a little of int4's cost, int8 nearly all of it.
                cost=dict(
                    zip(
                        names,
                        [int4, int4 * 0.86, int4 * 0.73, int4 * rng.random() * 0.01, 0.0],
                        strict=True,
                    )
                ),
            )
        )
    return Sensitivity(
        family=family, base_perplexity=20.0, positions=1000, seconds=1, modules=modules
    )


def test_fused_projections_and_experts_take_one_precision():
    assert unit_of("model.layers.3.self_attn.k_proj") == unit_of("model.layers.3.self_attn.q_proj")
    assert unit_of("model.layers.3.self_attn.k_proj") != unit_of("model.layers.4.self_attn.k_proj")
    assert unit_of("model.layers.3.mlp.up_proj") == unit_of("model.layers.3.mlp.gate_proj")
    assert unit_of("model.layers.3.mlp.down_proj") == "model.layers.3.mlp.down_proj"
    experts = {unit_of(f"model.layers.1.mlp.experts.{i}.{p}") for i in range(4) for p in LEAVES[4:]}
    assert experts == {"model.layers.1.mlp.experts.*"}
    path = frontier(sensitivity(3, 0))
    for mix in path:
        by_unit: dict[str, set[str]] = {}
        for name, precision in mix.precisions.items():
            by_unit.setdefault(unit_of(name), set()).add(precision)
        assert all(len(precisions) == 1 for precisions in by_unit.values())


@pytest.mark.parametrize("seed", range(5))
def test_the_budget_holds_and_no_assignment_of_as_few_bits_predicts_less(seed):
    measured = sensitivity(1, seed)
    path = frontier(measured, (4.2, 4.5, 6.0, 9.0))
    assert path[0].counts() == {"int4": 7} and path[-1].counts() == {"16-bit": 7}
    assert all(a.avg_bits < b.avg_bits for a, b in itertools.pairwise(path))
    assert all(a.predicted_log_ratio > b.predicted_log_ratio for a, b in itertools.pairwise(path))
    # Every assignment of the layer's four units (q+k+v, o, gate+up, down), brute force.
    units = sorted({unit_of(m.name) for m in measured.modules})
    family = FAMILIES["int"]
    total = sum(m.weights for m in measured.modules)
    assignments = []
    for pick in itertools.product(family, repeat=len(units)):
        chosen = dict(zip(units, pick, strict=True))
        precision = {m.name: chosen[unit_of(m.name)] for m in measured.modules}
        bits = sum(m.weights * precision[m.name].bits for m in measured.modules) / total
        cost = sum(m.cost[precision[m.name].name] for m in measured.modules)
        assignments.append((bits, cost))

    def best_within(budget: float) -> float:
        return min(cost for bits, cost in assignments if bits <= budget + 1e-12)

    # The knapsack rounds each unit's bits up to a step of the range: it may give up that much.
    slack = len(units) * (16 - 4.125) / STEPS
    for budget in (4.2, 4.5, 6.0, 9.0):
        chosen = within_bits(path, budget)
        assert chosen.avg_bits <= budget
        assert best_within(budget) - 1e-15 <= chosen.predicted_log_ratio
        assert chosen.predicted_log_ratio <= best_within(budget - slack) + 1e-15


def test_the_mix_is_one_recipe_with_a_config_group_per_precision():
    recipe = render(RecipeArgs(preset="W4A16"))
    mix = within_bits(frontier(sensitivity(2, 1), (5.0,)), 5.0)
    mixed = mixed_recipe(recipe, mix)
    gptq = quantizing_modifiers(mixed.yaml)["GPTQModifier"]
    assert "scheme" not in gptq
    by_precision: dict[str, set[str]] = {}
    for name, precision in mix.precisions.items():
        by_precision.setdefault(precision, set()).add(name)
    assert len(by_precision) >= 2, by_precision  # a mix, not one precision
    expected = {p.name: p for p in FAMILIES["int"] if p.scheme and p.name in by_precision}
    assert set(gptq["config_groups"]) == {f"group_{name}" for name in expected}
    for name, precision in expected.items():
        group = gptq["config_groups"][f"group_{name}"]
        assert set(group["targets"]) == by_precision[name]
        weights = group["weights"]
        assert weights["num_bits"] == (8 if name == "int8" else 4) and weights["symmetric"]
        assert weights["group_size"] == (precision.group_size or 128)
    assert gptq["ignore"][0] == "lm_head"
    assert set(gptq["ignore"][1:]) == by_precision.get("16-bit", set())
    assert mixed.sha256 != recipe.sha256 and "mixed precision:" in mixed.notes[-1]
    yaml.safe_load(mixed.yaml)  # plain YAML, no anchors


def test_budgets_a_recipe_cannot_mix_or_its_family_cannot_reach_are_refused():
    w4a16 = render(RecipeArgs(preset="W4A16"))
    check_budget(w4a16, TargetArgs(avg_bits=4.125))
    with pytest.raises(InputError) as below:
        check_budget(w4a16, TargetArgs(avg_bits=4.0))
    assert below.value.field == "target.avg_bits"
    assert "below what the int family reaches" in below.value.problem
    assert "at least 4.125" in below.value.fix
    with pytest.raises(InputError) as unknown:
        check_budget(render(RecipeArgs(preset="W8A8")), TargetArgs(avg_bits=6))
    assert "W4A16 or NVFP4A16" in unknown.value.fix
    with pytest.raises(ValueError):
        TargetArgs(avg_bits=16.5)
    # A ratio target: mixed for the presets it knows, the old search for the others.
    ratio = TargetArgs(max_perplexity_ratio=1.02)
    assert mixes(w4a16, ratio) and not mixes(render(RecipeArgs(preset="W8A8")), ratio)
    assert not mixes(w4a16, TargetArgs(max_perplexity_ratio=1.02, method="leave_unquantized"))
    assert not mixes(w4a16, TargetArgs())


@pytest.mark.parametrize("family, fewer, more", [("int", "int4", "int8"), ("float", "fp4", "fp8")])
def test_sensitivity_costs_fewer_bits_more_on_the_tiny_model(tiny_model, family, fewer, more):
    """One pass on random weights: only its shape is checked here (quality: the yardstick)."""
    from compressflow.evaluation.sensitivity import measure_sensitivity
    from compressflow.results import FetchedModel, HeldOutText

    model = FetchedModel.model_construct(
        path=str(tiny_model), model_class="AutoModelForCausalLM", trust_remote_code=False
    )
    held_out = HeldOutText(
        source="ids",
        input_ids=[[1, *range(5, 40)], [1, *range(50, 70)]],
        excluded_calibration_samples=0,
    )
    measured = measure_sensitivity(str(tiny_model), model, held_out, family, ["lm_head"])
    assert measured.positions == 35 + 20  # every next-token position of both texts
    assert measured.base_perplexity > 1
    names = [m.name for m in measured.modules]
    assert "lm_head" not in names and len(names) == len(set(names)) > 0
    assert all(module.cost["16-bit"] == 0 for module in measured.modules)
    # Signed per module (the gradient term can favour a rounding); smaller with more bits over all.
    assert sum(abs(m.cost[more]) for m in measured.modules) < sum(
        abs(m.cost[fewer]) for m in measured.modules
    )


def test_the_trade_off_reads_at_a_glance_in_the_card_and_the_run():
    import xml.etree.ElementTree as ElementTree

    from compressflow.recipes.mixed import chart_points, describe_mix
    from compressflow.reporting.model_card import target_section
    from compressflow.reporting.tradeoff import tradeoff_svg
    from compressflow.results import MixedPrecision, TargetRound, TargetSearch

    measured = sensitivity(2, 3)
    path = frontier(measured, (4.5,))
    mix = within_bits(path, 4.5)
    round_1 = TargetRound(
        round=1,
        unquantized=[],
        perplexity=20.2,
        ratio=1.01,
        size_bytes=10**6,
        met=True,
        avg_bits=mix.avg_bits,
        predicted_ratio=mix.predicted_ratio(),
    )
    points = chart_points(measured, path, [round_1], [4.5, 6.0])
    labels = [p.label for p in points]
    assert labels[0] == "base model" and "int4 everywhere (round-to-nearest)" in labels
    assert "mix at 4.5 bits (predicted)" in labels and labels[-1].startswith("round 1:")
    search = TargetSearch(
        max_perplexity_ratio=0,
        max_rounds=2,
        base_perplexity=20.0,
        held_out_source="file:held_out.jsonl",
        held_out_samples=64,
        ranked_modules=len(measured.modules),
        rounds=[round_1],
        chosen_round=1,
        avg_bits=4.5,
        mix=MixedPrecision(
            family="int",
            precisions=mix.precisions,
            avg_bits=mix.avg_bits,
            sensitivity_seconds=3,
            points=points,
        ),
    )
    card = target_section(search)
    assert "## Mixed precision" in card and "at most 4.5 bits per weight" in card
    assert "![size vs held-out perplexity](tradeoff.svg)" in card
    assert "| model.layers.1 |" in card  # the per-layer map
    assert "data:image/svg+xml;base64," in target_section(search, inline_chart=True)
    svg = ElementTree.fromstring(tradeoff_svg(points))
    circles = svg.findall("{http://www.w3.org/2000/svg}circle")
    assert len(circles) == len(points)
    described = describe_mix(round_1, mix, 0)
    assert (
        f"{mix.avg_bits:.3f} bits per weight" in described and "met" not in described
    )  # no ratio asked
