"""One test per bad input: the error names the field and the fix, comes in seconds, and no
output folder is created. `validate` runs the flow's own pre-calibration checks."""

from __future__ import annotations

import json
import shutil
import time

import pytest
from pydantic import ValidationError

from compressflow.errors import DatasetError, ModelFetchError, PublishError, RecipeError
from compressflow.flows.cli import main as cli
from compressflow.flows.validate import validate

BAD_YAML = "quant_stage:\n  quant_modifiers:\n    GPTQModifier: {targets: [Linear\n"
TYPO_MODIFIER = (
    "quant_stage:\n  quant_modifiers:\n    GPTQModifer: {targets: Linear, scheme: W4A16}\n"
)
BAD_SCHEME = (
    "quant_stage:\n  quant_modifiers:\n    GPTQModifier: {targets: Linear, scheme: W4A15}\n"
)
GROUPS_OF_96 = """
quant_stage:
  quant_modifiers:
    GPTQModifier:
      ignore: [lm_head]
      config_groups:
        group_0:
          targets: [Linear]
          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 96}
"""
PLACEHOLDER = "quant_stage:\n  quant_modifiers:\n    GPTQModifier: {targets: Linear, scheme: W4A16, dampening_frac: $damp}\n"


def two_args_collator(batch, extra):
    raise AssertionError("never called: the signature check refuses it first")


@pytest.fixture(scope="module")
def models(tiny_model, tmp_path_factory):
    """Variants of the tiny model, without weights: validation must never need them."""
    root = tmp_path_factory.mktemp("models")

    def variant(name, **config_changes):
        folder = root / name
        shutil.copytree(tiny_model, folder, ignore=shutil.ignore_patterns("*.safetensors"))
        config = json.loads((folder / "config.json").read_text())
        config.update(config_changes)
        (folder / "config.json").write_text(json.dumps(config))
        return str(folder)

    return {
        "plain": variant("plain"),
        "remote_code": variant("remote", auto_map={"AutoModelForCausalLM": "modeling.Custom"}),
        "quantized": variant("quantized", quantization_config={"quant_method": "awq"}),
    }


def params(models, tmp_path, model=None, dataset=None, recipe=None, output=None):
    return dict(
        model={"model_id": models["plain"], **(model or {})},
        dataset={
            "dataset_name": "python_docs",
            "text_samples": 8,
            "max_seq_len": 64,
            **(dataset or {}),
        },
        recipe={"recipe": "W4A16", **(recipe or {})},
        output={"save_directory": str(tmp_path / "out"), **(output or {})},
    )


def test_valid_parameters_pass_without_any_weights(models, tmp_path):
    report = validate(**params(models, tmp_path))
    assert [c.name for c in report.checks] == [
        "recipe",
        "model",
        "architecture",
        "dataset",
        "output",
        "memory",
        "traceability",
    ]
    assert report.checks[5].detail.startswith("classic path, weights on cpu, computed on cpu")
    assert "3 subgraphs" in report.checks[6].detail
    assert not (tmp_path / "out").exists()


CASES = {
    "malformed YAML": ({"recipe": {"recipe": BAD_YAML}}, RecipeError, ["not valid YAML", "line"]),
    "unknown modifier": (
        {"recipe": {"recipe": TYPO_MODIFIER}},
        RecipeError,
        ["GPTQModifer", "GPTQModifier"],
    ),
    "unknown scheme": ({"recipe": {"recipe": BAD_SCHEME}}, RecipeError, ["W4A15"]),
    "placeholder without value": (
        {"recipe": {"recipe": PLACEHOLDER}},
        RecipeError,
        ["$damp", "recipe_args"],
    ),
    "value without placeholder": (
        {"recipe": {"recipe": PLACEHOLDER, "recipe_args": {"damp": 0.1, "dampening": 0.2}}},
        RecipeError,
        ["dampening", "no placeholder"],
    ),
    "group size that does not divide the layers": (
        {"recipe": {"recipe": GROUPS_OF_96}},
        RecipeError,
        ["groups of 96", "q_proj (256 columns)", "ignore"],
    ),
    "unknown preset": ({"recipe": {"recipe": "W4A61"}}, RecipeError, ["W4A16"]),
    "negative dampening_frac": (
        {"recipe": {"recipe_args": {"dampening_frac": -0.1}}},
        RecipeError,
        ["GPTQModifier.dampening_frac", "-0.1", "(0.0, 1.0]"],
    ),
    "smoothing_strength above 1": (
        {"recipe": {"recipe": "W8A8", "recipe_args": {"smoothing_strength": 3}}},
        RecipeError,
        ["smoothing_strength", "[0.0, 1.0]"],
    ),
    "unknown dataset shortcut": (
        {"dataset": {"dataset_name": "wikitxt"}},
        DatasetError,
        ["wikitext"],
    ),
    "missing local model": (
        {"model": {"model_id": "./no/such/model"}},
        ModelFetchError,
        ["does not exist"],
    ),
    "uncached hub model": (
        {"model": {"model_id": "acme/not-cached"}},
        ModelFetchError,
        ["not in the local hub cache"],
    ),
    "ClearML model id": (
        {"model": {"model_id": "4d3c2b1a", "clearml_model": True}},
        ModelFetchError,
        ["4d3c2b1a", "ClearML"],
    ),
    "zero samples for a data recipe": (
        {"dataset": {"text_samples": 0}},
        DatasetError,
        ["text_samples", "needs calibration data"],
    ),
    "more samples than the dataset": (
        {"dataset": {"text_samples": 100_000}},
        DatasetError,
        ["100000"],
    ),
    "max_seq_len above the model's": (
        {"dataset": {"max_seq_len": 100_000}},
        DatasetError,
        ["max_seq_len", "2048"],
    ),
    "vision samples without processor": (
        {"dataset": {"vision_samples": 4}},
        DatasetError,
        ["processor", "vision_samples=0"],
    ),
    "loader outside the allow-list": (
        {"dataset": {"dataset_loader": "os:getcwd"}},
        DatasetError,
        ["allow-list"],
    ),
    "loader that does not import": (
        {"dataset": {"dataset_loader": "test_validate.nowhere:load"}},
        DatasetError,
        ["cannot import"],
    ),
    "collator with the wrong signature": (
        {"dataset": {"data_collator": "test_validate:two_args_collator"}},
        DatasetError,
        ["data_collator", "1 argument"],
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_fails_fast_and_clearly(models, tmp_path, case):
    assert_refused_fast(models, tmp_path, *CASES[case])


def assert_refused_fast(models, tmp_path, changes: dict, error: type, words: list[str]) -> None:
    started = time.perf_counter()
    with pytest.raises(error) as raised:
        validate(**params(models, tmp_path, **changes))
    assert time.perf_counter() - started < 30, "validation must not load weights or calibrate"
    assert "Fix:" in str(raised.value)
    for word in words:
        assert word in str(raised.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "variant, words",
    [("remote_code", ["trust_remote_code: true"]), ("quantized", ["already quantized (awq)"])],
)
def test_models_that_would_fail_after_loading_are_refused_first(models, tmp_path, variant, words):
    with pytest.raises(ModelFetchError) as raised:
        validate(**params(models, tmp_path, model={"model_id": models[variant]}))
    for word in words:
        assert word in str(raised.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field, value", [("max_seq_len", 0), ("text_samples", -1)])
def test_out_of_range_numbers_are_refused_by_the_schema(models, tmp_path, field, value):
    with pytest.raises(ValidationError, match=field):
        validate(**params(models, tmp_path, dataset={field: value}))


def test_output_folder_holding_another_model_is_refused(models, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_text("another model")
    with pytest.raises(PublishError, match="overwrite: true"):
        validate(**params(models, tmp_path))
    assert (tmp_path / "out" / "model.safetensors").read_text() == "another model"


def test_cli_exit_status_and_message(models, tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text(json.dumps(params(models, tmp_path)))
    assert cli(["validate", str(good)]) == 0
    assert "Parameters are valid" in capsys.readouterr().out

    bad = tmp_path / "bad.yaml"
    bad.write_text(json.dumps(params(models, tmp_path, recipe={"recipe": "W4A61"})))
    assert cli(["validate", str(bad)]) == 2
    assert "did you mean W4A16" in capsys.readouterr().err


@pytest.fixture(scope="module")
def broken(tiny_model, tmp_path_factory):
    """What an interrupted download or a wrong file leaves behind."""
    root = tmp_path_factory.mktemp("broken")
    truncated = root / "truncated-model"
    shutil.copytree(tiny_model, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (root / "empty.jsonl").write_text("")
    (root / "binary.txt").write_bytes(bytes(range(256)) * 64)
    return root


@pytest.mark.parametrize(
    "case, error, words",
    [
        ("truncated weights", ModelFetchError, ["model.safetensors is truncated", "download"]),
        ("empty dataset file", DatasetError, ["empty.jsonl' is empty"]),
        ("binary dataset file", DatasetError, ["binary.txt' is not UTF-8 text"]),
    ],
)
def test_broken_files_users_do_not_notice_are_refused_in_seconds(
    models, broken, tmp_path, case, error, words
):
    changes = {
        "truncated weights": {"model": {"model_id": str(broken / "truncated-model")}},
        "empty dataset file": {"dataset": {"dataset_name": str(broken / "empty.jsonl")}},
        "binary dataset file": {"dataset": {"dataset_name": str(broken / "binary.txt")}},
    }[case]
    assert_refused_fast(models, tmp_path, changes, error, words)
