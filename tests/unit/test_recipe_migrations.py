"""Recipes in forms older llm-compressor took: migrated with a note, or refused with the new form.

Also the early refusal of what the worker's hardware cannot run (AWQ without an accelerator), in
`validate` (the flow's refusal: tests/e2e/test_hardware_refusal.py), before any weights load.
Fast: nothing calibrates.
"""

from __future__ import annotations

import logging
import time

import pytest
import yaml
from support.recipes import AWQ

from compressflow import compat
from compressflow.errors import RecipeError
from compressflow.flows.validate import validate
from compressflow.model import hardware
from compressflow.params import RecipeArgs
from compressflow.recipes.render import render
from compressflow.tasks.render_recipe import render_recipe

# The seed system's oneshot examples (seed 001) pass this recipe: a SparseZoo stub.
SEED_ZOO_STUB = "zoo:llm/llama3-8b/quantization-w8a8-channelwise-dynamic"

# Older llm-compressor's forms, as users' recipes carry them (not in the seed documents).
SMOOTHQUANT_FAMILY = """
quant_stage:
  quant_modifiers:
    SmoothQuantModifier:
      smoothing_strength: 0.8
      mappings: llama
    GPTQModifier:
      ignore: ["lm_head"]
      scheme: "W8A8"
      targets: "Linear"
"""
GPTQ_SEQUENTIAL_TARGETS = """
quant_stage:
  quant_modifiers:
    GPTQModifier:
      sequential_targets: ["LlamaDecoderLayer"]
      ignore: ["lm_head"]
      scheme: "W4A16"
      targets: "Linear"
"""
QUANTIZE = {"targets": "Linear", "scheme": "W4A16", "ignore": ["lm_head"]}


def modifier_args(result, name: str) -> dict:
    (stage,) = yaml.safe_load(result.yaml).values()
    (group,) = stage.values()
    return group[name]


def refused(recipe, **kwargs) -> RecipeError:
    with pytest.raises(RecipeError) as raised:
        render(RecipeArgs(recipe=recipe, **kwargs))
    return raised.value


# ---------------------------------------------------------------- SmoothQuant mappings


def test_smoothquant_family_name_becomes_that_familys_mappings(caplog):
    registry = compat.smoothquant_mappings()

    with caplog.at_level(logging.WARNING):
        result = render_recipe.fn(RecipeArgs(recipe=SMOOTHQUANT_FAMILY))
    expected = [[list(m.balance_layers), m.smooth_layers] for m in registry["LlamaForCausalLM"]]
    assert modifier_args(result, "SmoothQuantModifier")["mappings"] == expected
    assert result.modifiers == ["SmoothQuantModifier", "GPTQModifier"]
    (note,) = result.notes
    assert note == (
        "SmoothQuantModifier (quant_stage.quant_modifiers): legacy mappings: llama (a model family "
        "name) rewritten to the 2 mappings llm-compressor 0.14 keeps for LlamaForCausalLM, written "
        "out in the recipe (0.14 takes only a list of [[balance layers], smooth layer])"
    )
    assert f"Recipe migrated: {note}" in caplog.text


@pytest.mark.parametrize(
    "given, arch",
    [("LlamaForCausalLM", "LlamaForCausalLM"), ("Qwen2_MoE", "Qwen2MoeForCausalLM")],
)
def test_family_names_match_in_any_spelling(given, arch):
    registry = compat.smoothquant_mappings()

    result = render(
        RecipeArgs(recipe=SMOOTHQUANT_FAMILY.replace("mappings: llama", f"mappings: {given}"))
    )
    mappings = modifier_args(result, "SmoothQuantModifier")["mappings"]
    assert mappings == [[list(m.balance_layers), m.smooth_layers] for m in registry[arch]]
    assert arch in result.notes[0]


def test_unknown_mapping_family_is_refused_with_the_new_form():
    error = refused(SMOOTHQUANT_FAMILY.replace("mappings: llama", "mappings: lama"))
    assert error.field == "recipe.recipe"
    assert "mappings: 'lama'" in error.problem and "llama, " in error.problem
    assert "did you mean llama" in error.fix
    assert "[[balance layer regexes], smooth layer regex]" in error.fix
    assert '[[["re:.*q_proj", "re:.*k_proj", "re:.*v_proj"], "re:.*input_layernorm"]]' in error.fix


# ---------------------------------------------------------------- GPTQ sequential_targets


def test_sequential_targets_move_from_the_modifier_to_oneshot(caplog):
    with caplog.at_level(logging.WARNING):
        result = render_recipe.fn(RecipeArgs(recipe=GPTQ_SEQUENTIAL_TARGETS))
    assert result.sequential_targets == ["LlamaDecoderLayer"]
    assert "sequential_targets" not in modifier_args(result, "GPTQModifier")
    (note,) = result.notes
    assert note == (
        "GPTQModifier (quant_stage.quant_modifiers): legacy sequential_targets "
        "['LlamaDecoderLayer'] moved out of the modifier to oneshot's sequential_targets "
        "(llm-compressor 0.14 takes it only there; recipe.sequential_targets sets it)"
    )
    assert f"Recipe migrated: {note}" in caplog.text


def test_a_single_sequential_target_becomes_a_list():
    one = GPTQ_SEQUENTIAL_TARGETS.replace('["LlamaDecoderLayer"]', "LlamaDecoderLayer")
    assert render(RecipeArgs(recipe=one)).sequential_targets == ["LlamaDecoderLayer"]


def test_the_users_recipe_sequential_targets_still_win():
    args = RecipeArgs(recipe=GPTQ_SEQUENTIAL_TARGETS, sequential_targets=["Linear"])
    result = render(args)
    # Calibration and the traceability check take `args.sequential_targets or result's`.
    assert (args.sequential_targets or result.sequential_targets) == ["Linear"]
    assert "recipe.sequential_targets ['Linear'] given too; it wins" in result.notes[-1]


def test_modifiers_with_different_sequential_targets_are_refused():
    recipe = [
        {"SparseGPTModifier": {"sparsity": 0.5, "sequential_targets": ["LlamaDecoderLayer"]}},
        {"GPTQModifier": {**QUANTIZE, "sequential_targets": ["Linear"]}},
    ]
    error = refused(yaml.safe_dump(recipe))
    assert "different sequential_targets" in error.problem
    assert "recipe.sequential_targets" in error.fix


# ---------------------------------------------------------------- zoo stubs


def test_seed_zoo_stub_is_refused_with_the_preset_of_its_scheme():
    error = refused(SEED_ZOO_STUB)
    assert SEED_ZOO_STUB in error.problem and "SparseZoo" in error.problem
    assert error.fix.startswith("use preset W8A8 for the same scheme")


# ---------------------------------------------------------------- hints


def test_a_moved_field_points_where_it_went_not_at_a_similar_name():
    error = refused(
        yaml.safe_dump([{"QuantizationModifier": {**QUANTIZE, "sequential_targets": ["X"]}}])
    )
    assert "set recipe.sequential_targets" in error.fix and "did you mean" not in error.fix
    error = refused(yaml.safe_dump([{"GPTQModifier": {**QUANTIZE, "sequential_update": True}}]))
    assert "remove `sequential_update`" in error.fix and "did you mean" not in error.fix


def test_awq_given_quantization_arguments_points_at_a_quantization_modifier():
    error = refused(yaml.safe_dump([{"AWQModifier": {**QUANTIZE, "n_grid": 10}}], sort_keys=False))
    assert error.fix == (
        "AWQModifier only balances; put a QuantizationModifier "
        "{targets: Linear, scheme: W4A16, ignore: [lm_head]} after it in the same stage and keep "
        "only AWQModifier's own arguments on it"
    )


# ---------------------------------------------------------------- hardware


def test_awq_without_an_accelerator_is_refused_by_validate_in_seconds(
    tiny_model, tmp_path, no_accelerator
):
    started = time.perf_counter()
    with pytest.raises(RecipeError) as raised:
        validate(
            model={"model_id": str(tiny_model)},
            dataset={"dataset_name": "python_docs", "text_samples": 8, "max_seq_len": 64},
            recipe={"recipe": AWQ},
            output={"save_directory": str(tmp_path / "out")},
        )
    assert time.perf_counter() - started < 30
    message = str(raised.value)
    assert message.startswith(
        "recipe.recipe: AWQModifier (scheme W4A16) needs a CUDA GPU worker: this worker has no "
        "accelerator"
    )
    assert "Fix: run it on the gpu work pool" in message
    assert "use preset W4A16 (GPTQ, int4 weights in groups of 128), which runs on CPU" in message
    assert not (tmp_path / "out").exists()


def test_a_worker_with_an_accelerator_runs_awq(monkeypatch):
    monkeypatch.setattr(hardware, "accelerator", lambda: "cuda")
    hardware.refuse_unsupported(render(RecipeArgs(recipe=AWQ)))


def test_cpu_recipes_pass_without_an_accelerator(no_accelerator):
    for preset in ("W4A16", "W8A8", "FP8_DYNAMIC"):
        hardware.refuse_unsupported(render(RecipeArgs(recipe=preset)))
