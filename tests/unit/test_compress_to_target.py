"""Compress to a target: the smallest configuration whose held-out perplexity meets the target.

Without a flow: the parameter's refusals, the search schedule (doubling, then bisecting), the
ignore lists the rounds calibrate with, the refusal of recipes that cannot be searched, the run
key and the card's section. The flow itself, on the learned-weights yardstick:
tests/matrix/test_compress_to_target_yardstick.py.
"""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError
from support.recipes import quantizing_modifiers

from compressflow.errors import InputError, TargetNotMet
from compressflow.params import (
    CalibrationArgs,
    HeldOutArgs,
    ModelArgs,
    OutputArgs,
    RecipeArgs,
    TargetArgs,
)
from compressflow.recipes.render import render
from compressflow.recipes.target import (
    check_searchable,
    next_count,
    not_met,
    ranked_modules,
    with_unquantized,
)
from compressflow.recipes.tree import add_ignore
from compressflow.reporting.model_card import target_section
from compressflow.results import Calibration, ModuleMetric, TargetRound, TargetSearch

# parameters


@pytest.mark.parametrize("ratio", [0.5, 0.99, 1e-9])
def test_a_ratio_below_one_is_refused_naming_the_field_and_the_fix(ratio):
    with pytest.raises(ValidationError) as raised:
        TargetArgs(max_perplexity_ratio=ratio)
    message = str(raised.value)
    assert "target.max_perplexity_ratio: " in message
    assert "lower perplexity than the base" in message
    assert "Fix: give a ratio of 1.0 or more" in message


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"max_perplexity_ratio": -1}, "max_perplexity_ratio"),
        ({"max_perplexity_ratio": 11}, "max_perplexity_ratio"),
        ({"max_rounds": 0}, "max_rounds"),
        ({"max_rounds": 13}, "max_rounds"),
        ({"held_out": {"samples": 0}}, "samples"),
        ({"max_ratio": 1.02}, "max_ratio"),
    ],
)
def test_out_of_range_values_are_refused_by_the_schema(fields, named):
    with pytest.raises(ValidationError, match=named):
        TargetArgs(**fields)


def test_unset_is_zero_and_the_defaults_are_bounded():
    args = TargetArgs()
    assert args.max_perplexity_ratio == 0 and args.max_rounds == 6
    assert args.held_out == HeldOutArgs()
    assert TargetArgs(max_perplexity_ratio=1.0).max_perplexity_ratio == 1.0
    assert TargetArgs(max_perplexity_ratio=None).max_perplexity_ratio == 0  # None means unset


# the schedule


def schedule(needed: int, candidates: int, max_rounds: int) -> list[int]:
    """The counts the search tries when the target is met from `needed` modules up (monotone)."""
    tried: list[tuple[int, bool]] = [(0, needed == 0)]
    while len(tried) < max_rounds:
        count = next_count(tried, candidates)
        if count is None:
            break
        tried.append((count, count >= needed))
    return [count for count, _ in tried]


def test_the_recipe_as_asked_meeting_the_target_ends_the_search():
    assert schedule(needed=0, candidates=42, max_rounds=6) == [0]


def test_counts_double_until_a_hit_then_bisect_to_the_smallest():
    assert schedule(needed=5, candidates=42, max_rounds=12) == [0, 1, 2, 4, 8, 6, 5]
    assert schedule(needed=4, candidates=42, max_rounds=12) == [0, 1, 2, 4, 3]  # 3 misses
    assert schedule(needed=3, candidates=42, max_rounds=12) == [0, 1, 2, 4, 3]  # 3 meets
    assert schedule(needed=1, candidates=42, max_rounds=12) == [0, 1]
    # Whatever the threshold, the search ends on it: the smallest count that meets the target.
    for needed in range(1, 43):
        tried = schedule(needed, candidates=42, max_rounds=12)
        assert min(n for n in tried if n >= needed) == needed, needed
    # Rounds run out mid-bisection: the smallest hit so far (6) is what would be published.
    assert schedule(needed=5, candidates=42, max_rounds=6) == [0, 1, 2, 4, 8, 6]


def test_doubling_stops_at_every_candidate_and_the_search_then_ends():
    assert schedule(needed=99, candidates=5, max_rounds=12) == [0, 1, 2, 4, 5]
    assert schedule(needed=5, candidates=5, max_rounds=12) == [0, 1, 2, 4, 5]
    assert schedule(needed=1, candidates=0, max_rounds=12) == [0]


def test_bisection_uses_the_largest_miss_below_the_smallest_hit():
    # Not monotone: 4 met, 6 missed, 8 met; the next count lies between 2 (a miss) and 4.
    assert next_count([(0, False), (2, False), (4, True), (6, False)], 42) == 3
    assert next_count([(0, False), (2, False), (3, True)], 42) is None


def test_modules_are_ranked_by_their_round_one_error():
    calibration = Calibration(
        staging_path="/nowhere",
        seconds=1,
        peak_rss_mb=1,
        checkpoint_bytes=1,
        modules=[
            ModuleMetric(name="model.layers.0.mlp.up_proj", error=2.0),
            ModuleMetric(name="model.layers.0.mlp.down_proj", error=9.0),
            ModuleMetric(name="model.layers.1.mlp.down_proj"),  # no error: not a candidate
            ModuleMetric(name="model.layers.1.mlp.up_proj", error=2.0),
        ],
    )
    assert ranked_modules(calibration) == [
        "model.layers.0.mlp.down_proj",
        "model.layers.0.mlp.up_proj",
        "model.layers.1.mlp.up_proj",
    ]


# the recipes the rounds calibrate with


def test_exact_module_names_join_every_quantizing_modifiers_ignore_list():
    plain = render(RecipeArgs(preset="W8A8"))  # SmoothQuant, then GPTQ
    names = ["model.layers.3.mlp.down_proj", "model.layers.0.self_attn.o_proj"]
    mixed = with_unquantized(plain, names)
    gptq = quantizing_modifiers(mixed.yaml)["GPTQModifier"]
    assert gptq["ignore"] == ["lm_head", *names]  # exact names, after the recipe's own
    assert not any(entry.startswith("re:") for entry in gptq["ignore"][1:])
    assert list(quantizing_modifiers(mixed.yaml)) == ["GPTQModifier"]  # SmoothQuant untouched
    assert mixed.sha256 != plain.sha256 and mixed.modifiers == plain.modifiers
    assert "2 module(s)" in mixed.notes[-1] and names[0] in mixed.notes[-1]
    # llm-compressor's parser takes it, and the recipe as asked is unchanged.
    from compressflow.recipes.validate import validate

    validate(yaml.safe_load(mixed.yaml))
    assert "model.layers.3" not in plain.yaml
    assert with_unquantized(plain, []) is plain


def test_add_ignore_keeps_a_single_string_and_adds_each_name_once():
    kwargs = {"scheme": "W4A16", "ignore": "lm_head"}
    assert add_ignore(kwargs, ["a.b", "lm_head", "a.b"]) == ["a.b"]
    assert kwargs["ignore"] == ["lm_head", "a.b"]
    assert add_ignore(kwargs, ["a.b"]) == [] and kwargs["ignore"] == ["lm_head", "a.b"]
    bare = {"scheme": "W4A16"}
    assert add_ignore(bare, []) == [] and "ignore" not in bare


# recipes that cannot be searched, refused before anything loads


def test_a_recipe_without_gptq_is_refused_with_the_fix():
    fp8 = render(RecipeArgs(preset="FP8_DYNAMIC"))
    check_searchable(fp8, TargetArgs())  # no target: nothing to refuse
    with pytest.raises(InputError) as raised:
        check_searchable(fp8, TargetArgs(max_perplexity_ratio=1.02))
    error = raised.value
    assert error.field == "target.max_perplexity_ratio"
    assert "no GPTQModifier" in error.problem and "per-module error" in error.problem
    assert "W4A16" in error.fix and "to 0" in error.fix
    check_searchable(render(RecipeArgs(preset="W4A16")), TargetArgs(max_perplexity_ratio=1.02))


def test_validate_refuses_a_target_on_a_recipe_without_gptq(tiny_model, tmp_path):
    import time

    from compressflow.flows.validate import validate

    started = time.perf_counter()
    with pytest.raises(InputError, match="target.max_perplexity_ratio: .* no GPTQModifier"):
        validate(
            model={"model_id": str(tiny_model)},
            dataset={"text_samples": 0},
            recipe={"preset": "FP8_DYNAMIC"},
            output={"save_directory": str(tmp_path / "out")},
            target={"max_perplexity_ratio": 1.02},
        )
    assert time.perf_counter() - started < 30
    assert not (tmp_path / "out").exists()


def test_the_run_key_holds_the_target_only_when_one_is_set(tiny_model):
    from compressflow.store.identity import run_key
    from compressflow.tasks.fetch_model import fetch

    model = fetch(ModelArgs(model_id=str(tiny_model)))
    recipe = render(RecipeArgs(preset="W4A16"))
    key = [model, None, recipe, RecipeArgs(), OutputArgs(), CalibrationArgs()]
    plain = run_key(*key)
    assert run_key(*key, TargetArgs()) == plain
    assert run_key(*key, TargetArgs(max_perplexity_ratio=1.02)) != plain
    assert run_key(*key, TargetArgs(max_perplexity_ratio=1.02)) != run_key(
        *key, TargetArgs(max_perplexity_ratio=1.05)
    )


def test_the_run_key_changes_when_a_local_held_out_file_is_edited(tiny_model, tmp_path):
    """The held-out text decides which round is published: the same arguments over an edited
    file must not reuse the earlier result."""
    from compressflow.store.identity import run_key
    from compressflow.tasks.fetch_model import fetch

    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text('{"text": "one"}\n')
    key = [fetch(ModelArgs(model_id=str(tiny_model))), None, render(RecipeArgs(preset="W4A16"))]
    key += [RecipeArgs(), OutputArgs(), CalibrationArgs()]
    target = TargetArgs(max_perplexity_ratio=1.02, held_out={"dataset_name": str(held_out)})
    before = run_key(*key, target)
    assert run_key(*key, target) == before
    held_out.write_text('{"text": "one, edited"}\n')
    assert run_key(*key, target) != before


# what the run says


def search_of(*rounds: tuple[int, float, int], chosen: int | None) -> TargetSearch:
    names = [f"model.layers.{i}.mlp.down_proj" for i in range(8)]
    return TargetSearch(
        max_perplexity_ratio=1.02,
        max_rounds=6,
        base_perplexity=30.0,
        held_out_source="local:held_out.jsonl",
        held_out_samples=64,
        ranked_modules=8,
        rounds=[
            TargetRound(
                round=i + 1,
                unquantized=names[:count],
                perplexity=30.0 * ratio,
                ratio=ratio,
                size_bytes=size,
                met=ratio <= 1.02,
            )
            for i, (count, ratio, size) in enumerate(rounds)
        ],
        chosen_round=chosen,
    )


def test_the_card_lists_the_layers_kept_unquantized_and_the_size_cost():
    search = search_of((0, 1.05, 1_000_000), (1, 1.03, 1_050_000), (2, 1.01, 1_100_000), chosen=3)
    section = target_section(search)
    assert section.startswith("## Compressed to a target")
    assert (
        "`model.layers.0.mlp.down_proj`" in section and "`model.layers.1.mlp.down_proj`" in section
    )
    assert "`model.layers.2.mlp.down_proj`" not in section
    assert "**Size cost**: +0.10 MB (+10.0%)" in section
    assert "| 3 | 2 | 30.3 | 1.0100 | met | 1.10 | published |" in section
    assert search.size_cost_bytes() == 100_000
    assert "no module is kept" in target_section(search_of((0, 1.01, 1_000_000), chosen=1))
    assert target_section(None) == ""


def test_the_refusal_names_the_best_ratio_and_the_layers_it_took():
    search = search_of((0, 1.05, 1_000_000), (1, 1.03, 1_050_000), chosen=None)
    error = not_met(search, 1.0001, candidates=8)
    assert isinstance(error, TargetNotMet) and error.field == "target.max_perplexity_ratio"
    assert "in 2 round(s)" in error.problem and "round 2 with 1 of 8 modules" in error.problem
    assert "reached 1.0300" in error.problem and "nothing was published" in error.problem
    assert "raise target.max_rounds (now 6, at most 12)" in error.fix
    assert "loosen target.max_perplexity_ratio (to 1.0300 or more)" in error.fix
    assert "more bits" in error.fix
