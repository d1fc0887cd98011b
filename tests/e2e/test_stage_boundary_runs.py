"""The boundary in a real run: a raw exception inside a stage's task ends the run with our error
naming the stage, its traceback in the log, and nothing written at the output."""

from __future__ import annotations

import pytest

from compressflow.errors import StageDefect
from compressflow.flows.compress import compress
from compressflow.params import DatasetArgs, ModelArgs, OutputArgs, RecipeArgs

pytestmark = pytest.mark.usefixtures("prefect_harness")


def test_a_raw_exception_inside_a_task_ends_the_run_naming_the_stage(
    tiny_model, tmp_path, monkeypatch, caplog
):
    def deep_inside(*args):
        raise IndexError("index 7 is out of bounds for dimension 0 with size 4")

    monkeypatch.setattr("compressflow.tasks.plan_memory.with_threads", deep_inside)
    with pytest.raises(StageDefect) as raised:
        compress(
            model=ModelArgs(model_id=str(tiny_model)),
            dataset=DatasetArgs(dataset_name="python_docs", text_samples=4, max_seq_len=32),
            recipe=RecipeArgs(recipe="W4A16"),
            output=OutputArgs(save_directory=str(tmp_path / "out")),
        )
    assert str(raised.value).startswith(
        "stage plan memory: IndexError: index 7 is out of bounds for dimension 0 with size 4, "
        "raised inside the plan memory stage"
    )
    assert "deep_inside" in caplog.text  # the traceback is in the run's log
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".*"))  # no staging or leftovers beside it
