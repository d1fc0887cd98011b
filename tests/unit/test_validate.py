"""One test per bad input: the error names the field and the fix, comes in seconds, and no
output folder is created. `validate` runs the flow's own pre-calibration checks. The CLI in a
process of its own: tests/e2e/test_validate_cli.py."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from contextlib import contextmanager

import pytest
from pydantic import ValidationError
from support.parameters import params

from compressflow.errors import (
    DatasetError,
    InputError,
    ModelFetchError,
    PublishError,
    RecipeError,
)
from compressflow.flows import cli as cli_module
from compressflow.flows.cli import main as cli
from compressflow.flows.cli import quiet
from compressflow.flows.validate import validate
from compressflow.params import ModelArgs

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


def test_valid_parameters_pass_without_any_weights(models, tmp_path):
    report = validate(**params(models, tmp_path))
    assert [c.name for c in report.checks] == [
        "recipe",
        "model",
        "architecture",
        "dataset",
        "weights",
        "output",
        "memory",
        "traceability",
    ]
    assert report.checks[4].detail == "not checked: the folder holds no safetensors weights"
    assert report.checks[6].detail.startswith("classic path, weights on cpu, computed on cpu")
    assert "3 subgraphs" in report.checks[7].detail
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
    "bits budget below the scheme family": (
        {"target": {"avg_bits": 3.5}},
        InputError,
        ["target.avg_bits", "int4", "at least 4.125"],
    ),
    "bits budget on a recipe that cannot mix": (
        {"recipe": {"recipe": "W8A8"}, "target": {"avg_bits": 6}},
        InputError,
        ["mixed precision", "W4A16 or NVFP4A16"],
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


PREFECT_YAML = """
deployments:
  - {name: compress, entrypoint: flows/compress.py:compress}
  - name: nightly-w4a16
    entrypoint: flows/compress.py:compress
    parameters: {model: {model_id: acme/model}}
  - {name: evaluate, entrypoint: flows/evaluate.py:evaluate, parameters: {held_out: {}}}
"""


def deployment(tmp_path, name: str) -> list[str]:
    prefect_yaml = tmp_path / "prefect.yaml"
    prefect_yaml.write_text(PREFECT_YAML)
    return ["validate", "--deployment", name, "--prefect-yaml", str(prefect_yaml)]


def refused_lines(capsys, argv: list[str]) -> list[str]:
    assert cli(argv) == 2
    printed = capsys.readouterr()
    assert printed.out == ""
    lines = printed.err.splitlines()
    assert all(line.startswith("error: ") and ". Fix: " in line for line in lines), lines
    return lines


def test_cli_deployment_without_parameters_says_they_come_from_the_run(tmp_path, capsys):
    assert refused_lines(capsys, deployment(tmp_path, "compress")) == [
        "error: model: deployment 'compress' sets no model: its parameters come from the run. "
        "Fix: put them in a file and run `compressflow validate params.yaml`"
    ]


def test_cli_names_unknown_groups_and_the_known_ones(models, tmp_path, capsys):
    good = params(models, tmp_path)
    file = tmp_path / "params.yaml"
    # tracking and verify are known groups, set aside: they only apply to a run.
    file.write_text(json.dumps({**good, "datasets": {}, "tracking": {}, "verify": {}}))
    assert refused_lines(capsys, ["validate", str(file)]) == [
        "error: datasets: not a parameter group. Fix: did you mean dataset? the groups are: "
        "model, dataset, recipe, output, tracking, verify, calibration, target"
    ]


def test_cli_prints_schema_errors_as_field_problem_fix(models, tmp_path, capsys):
    file = tmp_path / "params.yaml"
    file.write_text(json.dumps(params(models, tmp_path, dataset={"text_samples": -1, "seeds": 1})))
    lines = refused_lines(capsys, ["validate", str(file)])
    assert lines[0] == (
        "error: dataset.text_samples: Input should be greater than or equal to 0, got -1. "
        "Fix: give a value that satisfies this"
    )
    assert lines[1].startswith(
        "error: dataset.seeds: not a field of dataset. Fix: did you mean seed? "
        "dataset's fields are: dataset_name, "
    )
    assert len(lines) == 2


def test_cli_reports_every_groups_schema_errors_before_any_check(models, tmp_path, capsys):
    bad = params(
        models,
        tmp_path,
        dataset={"max_seq_len": 0},
        recipe={"pipeline": "fastest"},
        output={"overwrite": "maybe"},
    )
    bad["model"] = {"revision": "main"}
    bad["calibration"] = {"batch_size": -1}
    bad["verify"] = {"samples": 100}  # applies only to a run, but a typo is caught here too
    # The output check would refuse this folder: a check ran if its error shows.
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_text("another model")
    file = tmp_path / "params.yaml"
    file.write_text(json.dumps(bad))
    lines = refused_lines(capsys, ["validate", str(file)])
    fields = [line.removeprefix("error: ").split(": ", 1)[0] for line in lines]
    assert fields == [
        "model.model_id",
        "dataset.max_seq_len",
        "recipe.pipeline",
        "output.overwrite",
        "calibration.batch_size",
        "verify.samples",
    ]
    assert "Field required. Fix: add it" in lines[0]
    assert "got 'fastest'" in lines[2]


def test_cli_refuses_a_token_given_as_a_block_name_without_printing_it(models, tmp_path, capsys):
    token, key = "hf_QzXwVuTsRqPoNmLkJiHgFeDcBa01234567", "Q7ZK3M9XW2PL8RT4YV6N"
    bad = params(models, tmp_path, model={"hub_token_block": token})
    bad["tracking"] = {"clearml_block": key}
    file = tmp_path / "params.yaml"
    file.write_text(json.dumps(bad))
    lines = refused_lines(capsys, ["validate", str(file)])
    assert [line.split(": ", 2)[1] for line in lines] == [
        "model.hub_token_block",
        "tracking.clearml_block",
    ]
    assert all("looks like a secret value, not a block name" in line for line in lines)
    assert token[:6] not in "".join(lines) and key[:6] not in "".join(lines)
    with pytest.raises(ValidationError) as refused:  # pydantic's own text, for Python callers
        ModelArgs(model_id="m", hub_token_block=token)
    assert token[3:9] not in str(refused.value)
    with pytest.raises(ValidationError) as refused:  # validate(), which checks every group
        validate(model={"model_id": "m", "hub_token_block": token})
    assert "model.hub_token_block" in str(refused.value) and token[3:9] not in str(refused.value)


def test_cli_verbose_leaves_the_libraries_output_alone(models, tmp_path, capsys, monkeypatch):
    quieted = []

    @contextmanager
    def counted_quiet():
        quieted.append(True)
        yield

    monkeypatch.setattr(cli_module, "quiet", counted_quiet)
    file = tmp_path / "params.yaml"
    file.write_text(json.dumps(params(models, tmp_path)))
    assert cli(["validate", str(file), "--verbose"]) == 0
    assert quieted == []
    assert cli(["validate", str(file)]) == 0
    assert quieted == [True]


def test_quiet_drops_library_output_and_keeps_compressflow_warnings(capfd):
    with quiet():
        os.write(1, b"library chatter\n")
        os.write(2, b"a progress bar\n")
        logging.getLogger("compressflow.store.disk_space").warning("the disk is nearly full")
    printed = capfd.readouterr()
    assert "chatter" not in printed.out and "progress" not in printed.err
    assert "warning: the disk is nearly full\n" in printed.err


def test_cli_unknown_deployment_exits_2_listing_the_deployments(tmp_path, capsys):
    assert refused_lines(capsys, deployment(tmp_path, "nightly")) == [
        f"error: --deployment: {tmp_path / 'prefect.yaml'} has no deployment 'nightly' "
        "(it has: compress, nightly-w4a16, evaluate). Fix: did you mean nightly-w4a16?"
    ]
    assert refused_lines(capsys, deployment(tmp_path, "evaluate")) == [
        "error: --deployment: deployment 'evaluate' runs flows/evaluate.py:evaluate, not "
        "compress-model. Fix: validate a compress-model deployment: compress, nightly-w4a16"
    ]


def test_cli_deployment_whose_parameters_give_a_group_twice_exits_2_naming_both(tmp_path, capsys):
    prefect_yaml = tmp_path / "prefect.yaml"
    prefect_yaml.write_text(
        PREFECT_YAML.replace("{model: {model_id: acme/model}}", "{model: {}, model: {}}")
    )
    argv = ["validate", "--deployment", "nightly-w4a16", "--prefect-yaml", str(prefect_yaml)]
    (line,) = refused_lines(capsys, argv)
    assert line.startswith(
        f"error: --prefect-yaml: {prefect_yaml} sets `deployments[1].parameters.model` twice: "
        "line 6, column 18 and line 6, column 29"
    )


def test_cli_help_gives_examples_and_exit_statuses(capsys):
    with pytest.raises(SystemExit) as exited:
        cli(["validate", "--help"])
    assert exited.value.code == 0
    help_text = capsys.readouterr().out
    for text in (
        "compressflow validate params.yaml",
        "compressflow validate --deployment nightly-w4a16",
        "\n  model: {model_id: ",
        "\n  dataset: {",
        "\n  recipe: {",
        "\n  output: {",
        "\n  0  valid",
        "\n  2  invalid",
        "--verbose",
    ):
        assert text in help_text


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


# Settings that parse but that the library refuses when it interprets them: the model class
# built from config.json, the tokenizer built and used. Each is the model's files' refusal
# (field, file, key, the library's words, fix), never `StageDefect`, before anything is written.
INTERPRETED = {
    "rope type the class does not know": (
        "config.json",
        {"rope_parameters": {"rope_type": "nonsense", "rope_theta": 10000.0}},
        ["build the model class", "rope_parameters.rope_type", "KeyError: 'nonsense'"],
    ),
    "rope_scaling linear without its factor": (
        "config.json",
        {"rope_scaling": {"rope_type": "linear"}},
        ["rope_scaling.rope_type", "'factor'", "correct rope_scaling.rope_type in config.json"],
    ),
    "dtype int8": ("config.json", {"dtype": "int8"}, ["its key dtype", "not a floating-point"]),
    "dtype bool": ("config.json", {"dtype": "bool"}, ["its key dtype", "torch.bool"]),
    "torch_dtype int8": (
        "config.json",
        {"dtype": None, "torch_dtype": "int8"},
        ["its key torch_dtype", "correct torch_dtype in config.json"],
    ),
    "model_max_length of text": (
        "tokenizer_config.json",
        {"model_max_length": "abc"},
        ["the tokenizer in", "cannot be built from its files", "'int' and 'str'"],
    ),
    "model_input_names not a list": (
        "tokenizer_config.json",
        {"model_input_names": 5},
        ["the tokenizer in", "not iterable"],
    ),
}


def interpreted_variant(source, root, case: str, weights: bool = False) -> str:
    """The tiny model with one of INTERPRETED's changes (a None value removes the key)."""
    file, changes, _ = INTERPRETED[case]
    folder = root / case.replace(" ", "-")
    ignore = None if weights else shutil.ignore_patterns("*.safetensors")
    shutil.copytree(source, folder, ignore=ignore)
    settings = {**json.loads((folder / file).read_text()), **changes}
    (folder / file).write_text(json.dumps({k: v for k, v in settings.items() if v is not None}))
    return str(folder)


@pytest.mark.parametrize("case", INTERPRETED)
def test_settings_the_library_refuses_are_the_files_fault(tiny_model, tmp_path, case):
    model = interpreted_variant(tiny_model, tmp_path, case)
    _, _, words = INTERPRETED[case]
    assert_refused_fast({"plain": model}, tmp_path, {}, ModelFetchError, ["model.model_id", *words])


def test_the_flows_fetch_refuses_them_before_the_dataset(tiny_model, tmp_path):
    """With weights, as the flow fetches: refused by the fetch (in its child), not as a defect
    of a later stage (the weights' check, the memory plan)."""
    from compressflow.tasks.fetch_model import fetch

    for case in ("rope type the class does not know", "dtype int8"):
        model = interpreted_variant(tiny_model, tmp_path, case, weights=True)
        with pytest.raises(ModelFetchError, match="transformers cannot build the model class"):
            fetch(ModelArgs(model_id=model))
