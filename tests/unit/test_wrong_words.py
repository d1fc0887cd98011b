"""Errors name the parameter the user actually set, and the fix names a real parameter.

Each test calls one function with what it needs (a config written to a folder, a tiny model
built in memory), so none runs a flow.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from prefect.utilities.schema_tools import validate
from pydantic import ValidationError
from transformers import GPT2Config, LlamaConfig, LlamaForCausalLM

from compressflow.calibration import run as calibration_module
from compressflow.errors import (
    CalibrationError,
    InputError,
    QualityThresholdExceeded,
    RecipeError,
    VerificationError,
)
from compressflow.flows.evaluate import apply_gate
from compressflow.inputs import Inputs, RunArgs
from compressflow.model.tracing import check_quantized_layers, check_smoothquant_mappings
from compressflow.params import ModelArgs, QualityGate, RecipeArgs, SearchSpace, VerifyArgs
from compressflow.recipes.render import render
from compressflow.results import Calibration, FetchedModel, MemoryPlan, VerificationCheck
from compressflow.tasks import verify as verify_module
from compressflow.verification import reload as verification_reload

TINY_LLAMA = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
)


def config_folder(path: Path, config) -> FetchedModel:
    config.save_pretrained(path)
    return FetchedModel(
        path=str(path), source="local", model_id=path.name, identity="sha256:test", size_bytes=0
    )


# --- the recipe parameter the user set ----------------------------------------------------------


def test_group_size_refusal_of_a_preset_names_recipe_preset(tmp_path):
    # 192 columns: not a multiple of W4A16's groups of 128.
    model = config_folder(tmp_path, LlamaConfig(**{**TINY_LLAMA, "hidden_size": 192}))

    with pytest.raises(RecipeError) as raised:
        check_quantized_layers(model, render(RecipeArgs(preset="W4A16")))

    assert str(raised.value).startswith("recipe.preset: GPTQModifier quantizes")
    assert "recipe_args" in raised.value.fix


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (RecipeArgs(preset="W4A16", recipe_args={"ignore": ["re:.*"]}), "recipe.preset"),
        (
            RecipeArgs(
                recipe="quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n"
                "      targets: [NoSuchLayer]\n      scheme: W8A16\n"
            ),
            "recipe.recipe",
        ),
    ],
)
def test_a_modifier_that_would_quantize_no_layer_is_refused_on_the_meta_model(
    tmp_path, args, field
):
    # llm-compressor would load the weights, calibrate and publish an unquantized model.
    model = config_folder(tmp_path, LlamaConfig(**TINY_LLAMA))
    with pytest.raises(RecipeError) as raised:
        check_quantized_layers(model, render(args))
    assert str(raised.value).startswith(f"{field}: ")
    assert "would quantize no layer of LlamaForCausalLM" in raised.value.problem
    assert "set targets to module classes or names the model has" in raised.value.fix


def test_smoothquant_refusal_of_a_preset_names_recipe_preset(tmp_path):
    # GPT-2's layers are named c_attn / ln_1: SmoothQuant's default mappings match none of them.
    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128)
    model = config_folder(tmp_path, config)

    with pytest.raises(RecipeError) as raised:
        check_smoothquant_mappings(model, render(RecipeArgs(preset="W8A8")))

    assert str(raised.value).startswith("recipe.preset: SmoothQuant cannot smooth")


def test_verification_failure_of_a_preset_names_recipe_preset(tmp_path, monkeypatch):
    staging, source = tmp_path / "staging", tmp_path / "source"
    for folder in (staging, source):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    # The checkpoint reloads, but config.json lacks the quantization config the recipe implies.
    reloaded = VerificationCheck(name="reload", passed=True, detail="clean")
    monkeypatch.setattr(verification_reload, "reload", lambda *args, **kwargs: (None, reloaded))
    # The checks run here, not in a child, so the stand-in reload above is the one called.
    monkeypatch.setattr(verify_module, "in_child", lambda function, *args: function(*args))
    monkeypatch.setattr(verify_module, "create_markdown_artifact", lambda *args, **kwargs: None)
    calibration = Calibration(
        staging_path=str(staging), seconds=1, peak_rss_mb=1, checkpoint_bytes=1
    )
    model = FetchedModel(
        path=str(source), source="local", model_id="m", identity="sha256:test", size_bytes=0
    )

    with pytest.raises(VerificationError) as raised:
        verify_module.verify.fn(
            calibration,
            model,
            render(RecipeArgs(preset="W4A16")),
            MemoryPlan.model_construct(path="classic", placement="cpu"),
            VerifyArgs(),
            "out",
        )

    assert str(raised.value).startswith("recipe.preset: the compressed model failed verification")


def test_a_library_failure_calibrating_a_preset_names_recipe_preset(tmp_path, monkeypatch):
    def fails(**kwargs):
        raise ValueError("boom inside llm-compressor")

    tiny = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    monkeypatch.setattr(calibration_module, "load_for_calibration", lambda *args: tiny)
    monkeypatch.setattr(calibration_module, "load_processor", lambda model: None)
    monkeypatch.setattr(calibration_module, "capture_reference", lambda *args: tmp_path / "ref")
    monkeypatch.setattr("llmcompressor.oneshot", fails)
    model = FetchedModel(
        path=str(tmp_path), source="local", model_id="m", identity="sha256:test", size_bytes=0
    )

    with pytest.raises(CalibrationError) as raised:
        calibration_module.calibrate_here(
            Inputs(
                args=RunArgs(model=ModelArgs(model_id="m"), recipe=RecipeArgs(preset="W4A16")),
                recipe=render(RecipeArgs(preset="W4A16")),
                model=model,
                dataset=None,
                target=tmp_path / "out",
                key="k",
            ),
            MemoryPlan.model_construct(path="classic", placement="cpu"),
            str(tmp_path / "staging"),
            events=lambda *args: None,
        )

    message = str(raised.value)
    assert message.startswith("recipe.preset: llm-compressor failed while calibrating m")
    assert "boom inside llm-compressor" in message


# --- evaluate's gate ----------------------------------------------------------------------------


def test_the_quality_gate_fix_names_the_gate_parameter():
    with pytest.raises(QualityThresholdExceeded) as raised:
        apply_gate(["KL 0.5 > 0.1"], Path("/out/model"), QualityGate())

    fix = raised.value.fix
    assert "gate.on_threshold" in fix and "quality_gate" not in fix
    assert "on_threshold" in QualityGate.model_fields


# --- sweep's search space -----------------------------------------------------------------------


def test_an_empty_list_of_values_is_refused_by_the_parameters_with_the_fix():
    with pytest.raises(ValidationError) as raised:
        SearchSpace(recipe_args={"dampening_frac": [0.01], "block_size": []})

    error = raised.value.errors()[0]["ctx"]["error"]
    assert isinstance(error, InputError) and error.field == "space.recipe_args"
    assert "block_size" in error.problem and "at least one value" in error.fix


def test_the_form_schema_refuses_an_empty_list_of_values():
    schema = SearchSpace.model_json_schema()

    assert validate({"recipe_args": {"block_size": []}}, schema)
    assert not validate({"recipe_args": {"block_size": [64]}}, schema)


# --- SmoothQuant with every mapped layer ignored ------------------------------------------------

ALL_IGNORED = """
smooth_stage:
  smooth_modifiers:
    SmoothQuantModifier:
      smoothing_strength: 0.8
      ignore: ["re:.*proj$", "re:.*layernorm$"]
    GPTQModifier: {targets: [Linear], scheme: W8A8, ignore: [lm_head]}
"""


def test_smoothquant_with_every_mapped_layer_ignored_runs_with_a_warning(tmp_path, caplog):
    model = config_folder(tmp_path, LlamaConfig(**TINY_LLAMA))

    with caplog.at_level(logging.WARNING):
        check_smoothquant_mappings(model, render(RecipeArgs(recipe=ALL_IGNORED)))

    assert "SmoothQuant will smooth nothing" in caplog.text
    assert "every layer its mappings match is in its ignore list" in caplog.text
