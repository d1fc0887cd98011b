"""The torchrun launch of ranks, for real: two CPU ranks (gloo) on the real launcher and rank
entry; only the work inside each rank is a test function (distributed oneshot itself needs
accelerators). Two torchrun launches (~8 s); the launch command is checked, fast, in
tests/unit/test_multi_gpu.py.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from compressflow.errors import CalibrationError
from compressflow.runtime.distributed import run_distributed

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def ranks_import_tests(monkeypatch):
    """Ranks unpickle this module's functions by name: they need its folder on their path."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def logs_and_sums(value, events):
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    logging.getLogger("compressflow").info("calibrating layer 0 on rank %d", rank)
    events("progress", (rank, 2))
    total = torch.tensor([value + rank])
    dist.all_reduce(total)
    return {"rank": rank, "total": int(total), "devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


def rank_one_is_killed(events):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        print("rank 1: about to run out of memory", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    with open(os.environ["RANK_ZERO_PID"], "w") as file:
        file.write(str(os.getpid()))
    time.sleep(600)  # as a rank waiting in a collective for the dead one would


def test_ranks_log_to_the_run_prefixed_and_rank_zero_returns(ranks_import_tests, caplog):
    events = []
    with caplog.at_level(logging.INFO):
        result = run_distributed(
            logs_and_sums, (10,), 2, ["4", "5"], lambda *e: events.append(e), "calibration"
        )
    assert result == {"rank": 0, "total": 21, "devices": "4,5"}  # 10 + 11: both ranks summed
    messages = [record.getMessage() for record in caplog.records]
    assert "[rank 0] calibrating layer 0 on rank 0" in messages
    assert "[rank 1] calibrating layer 0 on rank 1" in messages
    assert events == [("progress", (0, 2))]  # rank 0's events only


def test_a_dying_rank_fails_the_run_naming_it_and_stops_the_others(
    ranks_import_tests, monkeypatch, tmp_path
):
    pid_file = tmp_path / "rank0.pid"
    monkeypatch.setenv("RANK_ZERO_PID", str(pid_file))
    started = time.monotonic()
    with pytest.raises(CalibrationError) as raised:
        run_distributed(rank_one_is_killed, (), 2, [], lambda *e: None, "calibration")
    assert time.monotonic() - started < 120
    error = raised.value
    assert "the calibration rank 1 process was killed by SIGKILL (exit code -9)" in error.problem
    assert "rank 1: about to run out of memory" in error.problem
    assert error.field == "calibration.max_cpu_memory_gb"
    rank_zero = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(rank_zero, 0)
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob("compressflow-ranks-*"))
