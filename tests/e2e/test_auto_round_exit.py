"""AutoRound's own `sys.exit(-1)` in a flow: the run fails with auto-round's words and the field
to change, never with a SystemExit that crashes it, and publishes nothing.

The plan's one-sample rule for AutoRound is taken away so that batches of 16 reach it; the rule
itself and the other ways a calibration process ends are tests/unit/test_calibration_runs.py.
"""

from __future__ import annotations

import pytest

from compressflow.errors import CalibrationError
from compressflow.params import RecipeArgs


@pytest.mark.usefixtures("prefect_harness")
def test_auto_rounds_own_exit_fails_the_run_with_its_words(tiny_model, tmp_path, monkeypatch):
    """The crash itself: with the plan's one-sample rule taken away, batches of 16 reach
    auto-round, which calls sys.exit(-1) in the calibration process."""
    from compressflow.flows.compress import compress
    from compressflow.model import memory
    from compressflow.params import CalibrationArgs, DatasetArgs, ModelArgs, OutputArgs

    monkeypatch.setattr(memory, "ONE_SAMPLE_MODIFIERS", {})
    # The plan is made here, where the patch above holds, not in a child process.
    monkeypatch.setattr(
        "compressflow.tasks.plan_memory.in_child", lambda function, *args: function(*args)
    )
    with pytest.raises(CalibrationError) as raised:
        compress(
            model=ModelArgs(model_id=str(tiny_model)),
            dataset=DatasetArgs(text_samples=32, max_seq_len=32),
            recipe=RecipeArgs(preset="W4A16_AUTOROUND", recipe_args={"iters": 2}),
            output=OutputArgs(save_directory=str(tmp_path / "out")),
            calibration=CalibrationArgs(batch_size=16),
        )
    error = raised.value
    assert error.field == "calibration.batch_size"
    assert "called sys.exit(-1) in auto_round/" in error.problem
    assert "try to set the `batch_size` to 1" in error.problem
    assert not (tmp_path / "out").exists()
