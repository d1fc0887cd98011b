"""The target strategies as one registry: exactly one applies to a run's recipe and target, the
same one the flow chose before they were registered, and a strategy registered beside them is
chosen and run with the flow's `Calibrations`, with no change to the flow.

Each strategy's own parts: tests/unit/test_compress_to_target.py (search target) and
tests/unit/test_mixed_precision.py (mix precision); end to end, the yardsticks under tests/matrix.
"""

from __future__ import annotations

import hashlib
import itertools

import pytest

from compressflow.flows import strategies
from compressflow.flows.strategies import STRATEGIES, Calibrations, choose
from compressflow.inputs import Inputs, RunArgs
from compressflow.params import ModelArgs, RecipeArgs, TargetArgs
from compressflow.recipes.mixed import mixes
from compressflow.recipes.render import render
from compressflow.recipes.target import with_unquantized
from compressflow.results import MemoryPlan
from compressflow.runtime.stages import Stages
from compressflow.runtime.strategies import Strategy

TARGETS = [
    TargetArgs(),
    TargetArgs(max_perplexity_ratio=1.02),
    TargetArgs(max_perplexity_ratio=1.02, method="leave_unquantized"),
    TargetArgs(max_perplexity_ratio=1.02, method="mixed_precision"),
    TargetArgs(avg_bits=5.0),
    TargetArgs(avg_bits=5.0, max_perplexity_ratio=1.02),
]
PRESETS = ["W4A16", "W8A8", "FP8_DYNAMIC"]


@pytest.fixture(scope="module")
def recipes():
    return {preset: render(RecipeArgs(preset=preset)) for preset in PRESETS}


@pytest.mark.parametrize("target", TARGETS, ids=repr)
@pytest.mark.parametrize("preset", PRESETS)
def test_exactly_one_strategy_applies_and_it_is_the_one_chosen_before(recipes, preset, target):
    recipe = recipes[preset]
    applying = [s.name for s in STRATEGIES.values() if s.applies(recipe, target)]
    # What the flow chose before the registry: a mix, else the recipe as asked, searched on
    # from there when the run has a target.
    before = (
        "mix precision"
        if mixes(recipe, target)
        else "search target"
        if target.wanted()
        else "as asked"
    )
    assert applying == [before]
    assert choose(recipe, target).name == before


def test_a_registered_strategy_is_chosen_and_run_with_the_flows_calibrations(
    recipes, monkeypatch, tmp_path
):
    recipe = recipes["W4A16"]
    seen = []

    def measure(path: str) -> float:  # a plain check, run as a stage without Prefect
        seen.append(path)
        return 1.0

    def run(calibrating) -> tuple:
        calibrating.run(measure, calibrating.inputs.model.path)
        return "calibration", calibrating.inputs.recipe, None

    dummy = Strategy(name="dummy", applies=lambda recipe, target: target.max_rounds == 7, run=run)
    monkeypatch.setattr(strategies, "STRATEGIES", {"dummy": dummy, **STRATEGIES})
    target = TargetArgs(max_perplexity_ratio=1.02, max_rounds=7)
    inputs = Inputs.model_construct(
        args=RunArgs(model=ModelArgs(model_id="some/model"), target=target),
        recipe=recipe,
        model=type("Fetched", (), {"path": str(tmp_path / "model")})(),
        dataset=None,
        target=tmp_path / "out",
        key="key",
    )
    calibrations = Calibrations(Stages(), inputs, MemoryPlan.model_construct(), held_out=None)

    strategy = choose(inputs.recipe, target)
    assert strategy is dummy
    assert strategy.run(calibrations) == ("calibration", recipe, None)
    assert seen == [str(tmp_path / "model")]
    assert calibrations.stagings == []  # it calibrated nothing: no staging folder to delete
    assert choose(recipe, TargetArgs(max_perplexity_ratio=1.02)).name == "mix precision"


@pytest.mark.parametrize("preset, modules", itertools.product(PRESETS, [[], ["lm_head"]]))
def test_a_recipes_sha256_is_the_sha256_of_its_yaml(recipes, preset, modules):
    recipe = with_unquantized(recipes[preset], modules)
    assert recipe.sha256 == hashlib.sha256(recipe.yaml.encode("utf-8")).hexdigest()
