"""What a killed run leaves beside the output is removed by the next run, in the flow: a dead
run's offload folder, never a live run's nor a user's. The rest of the source's and outputs'
safety, without a flow: tests/unit/test_source_safety.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.processes import dead_pid

from compressflow.params import ModelArgs, OutputArgs, RecipeArgs
from compressflow.store.manifest import MANIFEST


@pytest.mark.usefixtures("prefect_harness")
def test_the_next_run_removes_a_killed_runs_offload_folder_not_a_live_ones(tiny_model, tmp_path):
    from compressflow.flows.compress import compress

    target = tmp_path / "out"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        leftovers = {
            f".out.offload-{dead_pid()}": False,
            f".out.offload-{live.pid}": True,  # another run, still calibrating
            ".out.offload-mine": True,  # a user's folder with a similar name
        }
        for name in leftovers:
            (tmp_path / name).mkdir()
            (tmp_path / name / "weights.bin").write_text("a copy of the weights")
        published = compress(
            model=ModelArgs(model_id=str(tiny_model)),
            recipe=RecipeArgs(recipe="FP8_DYNAMIC"),
            output=OutputArgs(save_directory=str(target)),
        )
    finally:
        live.kill()
        live.wait()
    assert Path(published.path) == target and (target / MANIFEST).exists()
    for name, kept in leftovers.items():
        assert (tmp_path / name).exists() == kept, name
