"""One boundary for errors: what escapes a stage is ours, or a defect naming the stage.

An input's fault passes as our error (field, problem, fix); anything else that escapes a stage
becomes a StageDefect naming the stage, its words kept in the message and its traceback in the
log; a stage stopped at its time limit names the parameter that set it. Fault by provenance:
what a library raises while it interprets an input the user gave (`interpreting`) is that
input's refusal, naming the file and the key its words name; the rest stays a defect.
"""

from __future__ import annotations

import json
import logging
import pickle

import pytest

from compressflow.errors import (
    CompressflowError,
    DatasetError,
    InputError,
    ModelFetchError,
    StageDefect,
    StageTimedOut,
    interpreting,
    key_named,
)
from compressflow.runtime.stages import Stages, boundary


def test_our_errors_pass_as_they_are():
    refusal = InputError("dataset.max_seq_len", "is 0", "give a positive length")
    with pytest.raises(InputError) as raised, boundary("build dataset"):
        raise refusal
    assert raised.value is refusal


def test_anything_else_is_a_defect_naming_the_stage_with_its_words_and_traceback(caplog):
    caplog.set_level(logging.ERROR)
    with pytest.raises(StageDefect) as raised, boundary("check traceability"):
        [][3]  # what a library deep inside a model raises
    defect = raised.value
    assert defect.field == "stage check traceability"
    assert defect.problem.startswith("IndexError: list index out of range, raised inside")
    assert "defect" in defect.problem and "report it with this run's log" in defect.fix
    assert isinstance(defect.__cause__, IndexError)
    assert "Traceback" in caplog.text and "[][3]" in caplog.text
    # Re-raised in another process (a child's error, a worker's result): it pickles whole.
    assert str(pickle.loads(pickle.dumps(defect))) == str(defect)


def test_a_time_limit_names_the_parameter_that_set_it():
    with (
        pytest.raises(StageTimedOut) as raised,
        boundary("calibrate", "calibration.timeout_minutes"),
    ):
        raise TimeoutError("Scope timed out after 9.0 second(s).")
    assert raised.value.field == "calibration.timeout_minutes"
    assert "raise calibration.timeout_minutes" in raised.value.fix
    with pytest.raises(StageDefect), boundary("fetch model"):  # no limit of ours: a defect
        raise TimeoutError("read timed out")


def test_interrupts_and_prefect_signals_pass():
    with pytest.raises(KeyboardInterrupt), boundary("calibrate"):
        raise KeyboardInterrupt


def test_stages_run_puts_each_stage_inside_its_boundary():
    def refuse_odd_shapes(count):
        return {"shapes": count}["sizes"]

    with pytest.raises(StageDefect, match=r"^stage refuse odd shapes: KeyError: 'sizes'"):
        Stages().run(refuse_odd_shapes, 3)


def test_every_error_a_user_can_see_reads_field_problem_fix():
    for error in (
        StageDefect.of("verify", ValueError("boom")),
        StageTimedOut("calibration.timeout_minutes", "ran past", "raise it"),
    ):
        assert isinstance(error, CompressflowError)
        assert str(error) == f"{error.field}: {error.problem}. Fix: {error.fix}"


def test_what_a_library_raises_reading_an_input_is_that_inputs_refusal(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"dtype": "int8", "rope_parameters": {"rope_type": "nonsense"}}))
    with (
        pytest.raises(ModelFetchError) as raised,
        boundary("fetch model"),
        interpreting("model.model_id", config, ModelFetchError, "transformers cannot build"),
    ):
        raise KeyError("nonsense")  # as transformers' rope table does
    error = raised.value
    assert error.field == "model.model_id"
    assert error.problem == (
        f"transformers cannot build {config} (at its key rope_parameters.rope_type: "
        "\"nonsense\"): KeyError: 'nonsense'"
    )
    assert error.fix == (
        "correct rope_parameters.rope_type in config.json, or replace config.json with the "
        "model's original"
    )
    assert isinstance(error.__cause__, KeyError)
    assert str(pickle.loads(pickle.dumps(error))) == str(error)  # crosses from the child whole


def test_outside_the_block_it_stays_a_defect_and_ours_pass(tmp_path):
    data = tmp_path / "rows.jsonl"
    with pytest.raises(StageDefect), boundary("build dataset"):
        with interpreting("dataset.dataset_name", data, DatasetError):
            pass
        {}["rows"]  # our own code after the read: not the file's fault
    refusal = DatasetError("dataset.text_column", "is missing", "name it")
    with pytest.raises(DatasetError) as raised, interpreting("dataset.dataset_name", data):
        raise refusal
    assert raised.value is refusal
    # A time limit or memory is no input's fault: the boundary words them.
    for exc in (TimeoutError("limit"), MemoryError()):
        with pytest.raises(type(exc)), interpreting("dataset.dataset_name", data, DatasetError):
            raise exc


def test_the_fix_and_wording_can_be_given(tmp_path):
    with (
        pytest.raises(DatasetError) as raised,
        interpreting(
            "dataset.dataset_name",
            tmp_path / "a.csv",
            DatasetError,
            "'{source}' cannot be read",
            fix="re-export it",
            said=lambda exc: "ParserError: row 3",
        ),
    ):
        raise ValueError("deep inside pandas")
    assert str(raised.value) == (
        f"dataset.dataset_name: '{tmp_path / 'a.csv'}' cannot be read: ParserError: row 3. "
        "Fix: re-export it"
    )


@pytest.mark.parametrize(
    "words, key",
    [
        # a value the words quote wins: the deepest one
        ("ValueError: LlamaForCausalLM cannot be instantiated under `dtype=torch.int8`", "dtype"),
        ("KeyError: 'nonsense'", "rope_parameters.rope_type"),
        # transformers 5 names rope_parameters for what the file sets as rope_scaling
        (
            "Missing required keys in `rope_parameters` for 'rope_type'='linear'",
            "rope_scaling.rope_type",
        ),
        # else a key the words name
        ("hidden_size must be divisible by num_attention_heads", "hidden_size"),
        # a short key is a word the libraries use for other things; a bare word is no quote
        ("the type is wrong: nonsense", None),
    ],
)
def test_the_key_is_the_one_the_librarys_words_name(tmp_path, words, key):
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "type": "x",
                "dtype": "int8",
                "hidden_size": 256,
                "num_attention_heads": 3,
                "rope_parameters": {"rope_type": "nonsense"},
                "rope_scaling": {"rope_type": "linear"},
            }
        )
    )
    found = key_named(words, config)
    assert (found and found[0]) == key
    assert key_named(words, tmp_path / "missing.json") is None
    (tmp_path / "list.json").write_text("[1, 2]")
    assert key_named(words, tmp_path / "list.json") is None


def test_the_fuzzer_fails_a_case_that_ends_as_a_defect():
    """What a config the class refuses ended as before fault by provenance: the fuzzer's
    property must fail it (tests/support/fuzz.py CLASS_REJECTS draws such configs)."""
    from support import fuzz

    defect = StageDefect.of("memory", KeyError("nonsense"))
    with pytest.raises(AssertionError, match="an input's fault reported as a defect"):
        fuzz.check_refusal("rope_type nonsense", defect)
