"""One boundary for errors: what escapes a stage is ours, or a defect naming the stage.

An input's fault passes as our error (field, problem, fix); anything else that escapes a stage
becomes a StageDefect naming the stage, its words kept in the message and its traceback in the
log; a stage stopped at its time limit names the parameter that set it.
"""

from __future__ import annotations

import logging
import pickle

import pytest

from compressflow.errors import CompressflowError, InputError, StageDefect, StageTimedOut
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
