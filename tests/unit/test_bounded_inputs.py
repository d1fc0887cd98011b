"""Hostile input is refused at once with an error naming the field, not after minutes of work."""

from __future__ import annotations

import itertools
import time

import pytest
from pydantic import ValidationError

from compressflow.errors import InputError, ModelFetchError, RecipeError
from compressflow.recipes.load import load_recipe


def billion_laughs(levels: int = 9) -> str:
    """`a: &a [x, ...]`, `b: &b [*a, ...]`, ...: 2 kB of text, 9**levels values when expanded."""
    names = [chr(ord("a") + i) for i in range(levels)]
    lines = [f"{names[0]}: &{names[0]} [x, x, x, x, x, x, x, x, x]"]
    lines += [f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]" for p, n in itertools.pairwise(names)]
    return "\n".join(lines) + "\n"


def nested_python_lists(levels: int = 9) -> list:
    value: list = ["x"] * 9
    for _ in range(levels - 1):
        value = [value] * 9  # one list referenced 9 times, as a YAML alias is
    return value


# Far above the 0.3 s these take (the nested lists, the slowest) and far below what an unbounded
# parse costs (minutes, or never): a bound that fails on a bomb, not on a busy 2-core machine,
# where CI once measured 1.07 s.
QUICKLY = 5.0


def refused_quickly(call, error=RecipeError) -> Exception:
    start = time.perf_counter()
    with pytest.raises(error) as raised:
        call()
    assert time.perf_counter() - start < QUICKLY
    return raised.value


def test_a_billion_laughs_recipe_is_refused_before_it_expands():
    text = billion_laughs()
    assert len(text) < 2048
    error = refused_quickly(lambda: load_recipe(text))
    assert error.field == "recipe.recipe"
    assert "100,000 values" in error.problem and "aliases" in error.problem
    assert "without nested aliases" in error.fix


def test_ten_thousand_nested_lists_are_a_recipe_error_not_a_recursion_error():
    error = refused_quickly(lambda: load_recipe("[" * 10_000 + "]" * 10_000))
    assert error.field == "recipe.recipe"
    assert "deeper than the limit of 64 levels" in error.problem


def test_an_alias_inside_its_own_value_is_refused():
    error = refused_quickly(lambda: load_recipe("quant_stage: &a {quant_modifiers: [*a]}"))
    assert "never ends" in error.problem


def test_recipe_text_and_files_over_1_mib_are_refused_before_parsing(tmp_path):
    big = "quant_stage: {}\n# " + "x" * (1 << 20) + "\n"
    error = refused_quickly(lambda: load_recipe(big))
    assert error.field == "recipe.recipe" and "limit of 1,048,576 bytes" in error.problem

    path = tmp_path / "big.yaml"
    path.write_text(big)
    error = refused_quickly(lambda: load_recipe(str(path)))
    assert str(path) in error.problem and "limit of 1,048,576 bytes" in error.problem


def args_error(call) -> RecipeError:
    """The RecipeError inside pydantic's ValidationError; not str(): that writes out the input."""
    raised = refused_quickly(call, ValidationError)
    return raised.errors(include_input=False)[0]["ctx"]["error"]


def test_recipe_args_sharing_one_list_many_times_are_refused():
    from compressflow.params import RecipeArgs, SearchSpace

    error = args_error(lambda: RecipeArgs(recipe_args={"ignore": nested_python_lists()}))
    assert error.field == "recipe.recipe_args" and "100,000 values" in error.problem

    cycle: list = []
    cycle.append(cycle)
    error = args_error(lambda: RecipeArgs(recipe_args={"ignore": cycle}))
    assert error.field == "recipe.recipe_args" and "cycle" in error.problem

    error = args_error(lambda: SearchSpace(recipe_args={"ignore": [nested_python_lists()]}))
    assert error.field == "space.recipe_args"

    # 100 references to one 1 MB string: few values, but 100 MB once written out.
    error = args_error(lambda: RecipeArgs(recipe_args={"names": ["x" * 1_000_000] * 100}))
    assert "1,048,576 characters of text" in error.problem


def test_a_cli_parameter_file_of_nested_aliases_is_refused(tmp_path):
    from compressflow.flows.cli import read_yaml

    path = tmp_path / "params.yaml"
    path.write_text(billion_laughs())
    error = refused_quickly(lambda: read_yaml(path, "--params"), InputError)
    assert error.field == "--params" and "100,000 values" in error.problem


def test_an_oversized_or_too_deep_config_json_is_refused_naming_the_file(tmp_path):
    from compressflow.model.folder_checks.config import check_config
    from compressflow.params import ModelArgs

    args = ModelArgs(model_id=str(tmp_path))
    config = tmp_path / "config.json"
    with config.open("wb") as handle:
        handle.truncate(17 << 20)  # sparse: 17 MiB on paper, nothing written
    with pytest.raises(ModelFetchError) as raised:
        check_config(tmp_path, args)
    assert str(config) in raised.value.problem
    assert "limit of 16,777,216 bytes" in raised.value.problem

    config.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ModelFetchError, match="nests too deeply") as raised:
        check_config(tmp_path, args)  # not a RecursionError
    assert str(config) in raised.value.problem


def test_one_large_value_inserted_at_many_places_is_refused_before_filling():
    from compressflow.recipes.placeholders import substitute

    recipe = load_recipe("quant_stage: {targets: [" + ", ".join(["$ignore"] * 2_000) + "]}")[0]
    error = refused_quickly(lambda: substitute(recipe, {"ignore": list(range(1_000))}))
    assert error.field == "recipe.recipe_args" and "2,002,003 values" in error.problem

    recipe = load_recipe("quant_stage: {name: '" + "-${tag}" * 2_000 + "'}")[0]
    error = refused_quickly(lambda: substitute(recipe, {"tag": "x" * 1_000}))
    assert "about 2,002,000 characters of inserted text" in error.problem


def test_a_safetensors_header_claiming_over_100_mb_is_refused_before_it_is_read(tmp_path):
    from compressflow.model.folder_checks.weights import check_weight_files

    file = tmp_path / "model.safetensors"
    with file.open("wb") as handle:
        handle.write((1 << 30).to_bytes(8, "little"))  # a 1 GiB header, all of it sparse
        handle.truncate(2 << 30)
    error = refused_quickly(lambda: check_weight_files(tmp_path), ModelFetchError)
    assert f"{file} is not a readable safetensors file" in error.problem
    assert "claims 1,073,741,824 bytes" in error.problem
    assert "over the 100,000,000 that safetensors reads at most" in error.problem


def test_a_config_json_number_too_long_to_convert_is_refused_naming_the_file(tmp_path):
    from compressflow.model.folder_checks.config import check_config
    from compressflow.params import ModelArgs

    config = tmp_path / "config.json"
    config.write_text('{"vocab_size": ' + "9" * 5_000 + "}")  # Python converts 4,300 digits
    with pytest.raises(ModelFetchError, match="cannot be read as JSON") as raised:
        check_config(tmp_path, ModelArgs(model_id=str(tmp_path)))  # not a bare ValueError
    assert str(config) in raised.value.problem


def test_a_text_or_json_file_that_is_a_fifo_or_device_is_refused_unopened(tmp_path):
    import os
    import re
    from pathlib import Path

    from compressflow.limits import read_json, read_text

    fifo = tmp_path / "params.yaml"
    os.mkfifo(fifo)  # opening it would block until a writer came
    for path, kind in [(fifo, "a FIFO (named pipe)"), (Path("/dev/zero"), "a device")]:
        refused = re.escape(f"{path} is {kind}, not a regular file")
        with pytest.raises(InputError, match=f"^field: {refused}"):
            read_text(path, "the file", "field")
        with pytest.raises(ModelFetchError, match=f"^model.model_id: {refused}"):
            read_json(path, "model.model_id", ModelFetchError)


# ---------------------------------------------------------------- a key given twice (issue 55)

TWO_SCHEMES = """\
quant_stage:
  quant_modifiers:
    GPTQModifier:
      scheme: W4A16
      targets: Linear
      ignore: [lm_head]
      scheme: W8A8
"""


def test_a_recipe_that_sets_one_key_twice_is_refused_naming_the_key_and_both_lines(tmp_path):
    error = refused_quickly(lambda: load_recipe(TWO_SCHEMES))
    assert error.field == "recipe.recipe"
    assert (
        "sets `quant_stage.quant_modifiers.GPTQModifier.scheme` twice: line 4, column 7 "
        "('W4A16') and line 7, column 7 ('W8A8')" in error.problem
    )
    assert error.fix.startswith("keep one of them")

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(TWO_SCHEMES)
    error = refused_quickly(lambda: load_recipe(str(recipe)))
    assert str(recipe) in error.problem and "line 7, column 7" in error.problem

    # In a list, in flow style, and keys Python holds as one (1 and 1.0); a whole stage twice.
    for text, named in [
        ("s: {modifiers: [{GPTQModifier: {targets: a, targets: b}}]}", "s.modifiers[0]."),
        ("quant_stage: {1: x, 1.0: y}", "quant_stage.1.0"),
        ("quant_stage: {}\nquant_stage: {}\n", "`quant_stage`"),
    ]:
        assert named in refused_quickly(lambda text=text: load_recipe(text)).problem


def test_a_merge_key_may_override_what_it_merges_and_the_same_text_elsewhere_is_no_repeat():
    text = """\
base: &base {targets: Linear, scheme: W4A16}
quant_stage:
  quant_modifiers:
    GPTQModifier:
      <<: *base
      scheme: W8A8
other: {scheme: W4A16}
"""
    recipe = load_recipe(text)[0]
    assert recipe["quant_stage"]["quant_modifiers"]["GPTQModifier"] == {
        "targets": "Linear",
        "scheme": "W8A8",
    }
    assert load_recipe("a: {'1': x, 1: y}")[0] == {"a": {"1": "x", 1: "y"}}  # str and int keys


def test_a_cli_parameter_file_that_gives_a_group_twice_is_refused(tmp_path):
    from compressflow.flows.cli import read_yaml

    path = tmp_path / "params.yaml"
    path.write_text("model: {model_id: a}\nrecipe: {recipe: W4A16}\nmodel: {model_id: b}\n")
    error = refused_quickly(lambda: read_yaml(path, "--params"), InputError)
    assert error.field == "--params"
    assert f"{path} sets `model` twice: line 1, column 1 and line 3, column 1" in error.problem


def test_model_json_refuses_a_key_given_twice_with_two_values_and_keeps_one_value_twice(tmp_path):
    from compressflow.model.folder_checks.files import check_json_files

    tokenizer = tmp_path / "tokenizer.json"
    # Written as text: json.dumps cannot write a key twice.
    tokenizer.write_text('{"model": {"vocab": {"a": 0, "b": 1, "a": 0}, "type": "BPE"}}')
    check_json_files(tmp_path)  # the same value twice changes nothing

    tokenizer.write_text('{"model": {"vocab": {"a": 0, "b": 1, "a": 2}}, "added_tokens": []}')
    with pytest.raises(ModelFetchError) as raised:
        check_json_files(tmp_path)
    error = raised.value
    assert error.field == "model.model_id"
    assert f"{tokenizer} gives `model.vocab.a` twice, with two different values: 0, then 2" in (
        error.problem
    )
    assert "the one the model was trained with" in error.fix and "original" in error.fix

    # 1, 1.0 and true are equal in Python, not in the file.
    tokenizer.write_text('{"x": 1, "x": 1}')
    (tmp_path / "generation_config.json").write_text('{"do_sample": 1, "do_sample": true}')
    with pytest.raises(ModelFetchError, match="`do_sample` twice, with two different values"):
        check_json_files(tmp_path)


def test_config_json_with_a_key_given_twice_is_refused_at_the_config_check(tmp_path):
    from compressflow.model.folder_checks.config import check_config
    from compressflow.params import ModelArgs

    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "rope_parameters": {"rope_type": "default", '
        '"rope_theta": 10000.0, "rope_theta": 500000.0}}'
    )
    with pytest.raises(ModelFetchError, match="`rope_parameters.rope_theta` twice") as raised:
        check_config(tmp_path, ModelArgs(model_id=str(tmp_path)))
    problem = raised.value.problem
    assert "10000.0, then 500000.0" in problem and "cannot be read as JSON" not in problem
