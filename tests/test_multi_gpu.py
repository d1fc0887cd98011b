"""GPU hosts: which devices a host has, the refusal of too few, and the torchrun launch of ranks.

There is no GPU here: COMPRESSFLOW_GPU_DEVICES pretends a host has some, and the launch tests run
a real torchrun with two CPU ranks (gloo) on the real launcher and rank entry; only the work inside
each rank is a test function (distributed oneshot itself needs accelerators).
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
from compressflow.runtime import gpus
from compressflow.runtime.distributed import run_distributed, torchrun_command, torchrun_environment

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def ranks_import_tests(monkeypatch):
    """Ranks unpickle this module's functions by name: they need tests/ on their path."""
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


def test_devices_come_from_the_override_then_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("COMPRESSFLOW_GPU_DEVICES", "0, 1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert gpus.devices() == ["0", "1"]
    monkeypatch.setenv("COMPRESSFLOW_GPU_DEVICES", "none")
    assert gpus.devices() == []
    monkeypatch.delenv("COMPRESSFLOW_GPU_DEVICES")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,-1,3")  # CUDA stops at the first invalid one
    assert gpus.devices() == ["2"]
    monkeypatch.setenv("COMPRESSFLOW_GPU_SLOT_PREFIX", "host-a:")
    assert gpus.slot_name("2") == "host-a:gpu:2"


def test_a_cpu_host_takes_no_slot(monkeypatch):
    monkeypatch.delenv("COMPRESSFLOW_GPU_DEVICES", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpus.devices() == []
    with gpus.gpu_slots(1, None) as held:  # no server needed: nothing is asked of it
        assert held == []


def test_more_gpus_than_the_host_has_is_refused_with_the_field_and_fix(monkeypatch):
    monkeypatch.setenv("COMPRESSFLOW_GPU_DEVICES", "0")
    with pytest.raises(CalibrationError) as raised:
        gpus.refuse_too_few(2)
    error = raised.value
    assert error.field == "calibration.gpus"
    assert "calibration.gpus is 2, but this host's GPUs for calibration are 1 (0)" in error.problem
    assert "set calibration.gpus to 1 or less" in error.fix
    gpus.refuse_too_few(1)  # one is always allowed: a CPU host calibrates in one process
    monkeypatch.setenv("COMPRESSFLOW_GPU_DEVICES", "0,1")
    gpus.refuse_too_few(2)


def test_the_torchrun_command_and_environment(monkeypatch, tmp_path):
    assert torchrun_command(4, tmp_path) == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=4",
        "-m",
        "compressflow.runtime.rank",
        str(tmp_path),
    ]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    environment = torchrun_environment(["2", "3"])
    assert environment["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert environment["PATH"] == os.environ["PATH"]


@pytest.mark.matrix  # two torchrun launches (~8 s): the launch command is checked above, fast
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


@pytest.mark.matrix
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


@pytest.mark.parametrize(
    ("devices", "gpus", "samples", "words", "fix"),
    [
        ("0", 2, 8, "this host's GPUs for calibration are 1 (0)", ""),
        # each GPU calibrates on its own share
        ("0,1,2,3", 4, 3, "the dataset has 3 sample(s)", "set calibration.gpus to 3 or less"),
    ],
    ids=["too-few-gpus", "fewer-samples-than-gpus"],
)
def test_the_flows_checks_refuse_a_gpu_count_before_the_output_or_any_weights(
    tiny_model, tmp_path, monkeypatch, devices, gpus, samples, words, fix
):
    from compressflow.flows.validate import validate

    monkeypatch.setenv("COMPRESSFLOW_GPU_DEVICES", devices)
    with pytest.raises(CalibrationError) as raised:
        validate(
            model={"model_id": str(tiny_model)},
            dataset={"dataset_name": "python_docs", "text_samples": samples, "max_seq_len": 64},
            recipe={"recipe": "W4A16"},
            output={"save_directory": str(tmp_path / "out")},
            calibration={"gpus": gpus},
        )
    error = raised.value
    assert error.field == "calibration.gpus"
    assert words in error.problem and fix in error.fix
    assert not (tmp_path / "out").exists()


def test_a_run_whose_gpus_are_its_own_takes_them_without_a_slot(monkeypatch):
    monkeypatch.setenv("COMPRESSFLOW_GPU_DEVICES", "0,1,2")
    monkeypatch.setenv("COMPRESSFLOW_GPU_SLOTS", "false")  # a pod's: no Prefect server is asked
    with gpus.gpu_slots(2, None) as held:
        assert held == ["0", "1"]


@pytest.mark.parametrize(("samples", "world"), [(8, 2), (10, 4), (3, 3), (512, 7)])
def test_each_rank_calibrates_on_its_own_share_of_the_samples(samples, world):
    """llm-compressor reduces the statistics across ranks: the shares cover every sample once,
    and differ in size by one at most."""
    from compressflow.runtime.rank import rank_share

    shares = [rank_share(samples, rank, world) for rank in range(world)]
    assert [i for share in shares for i in share] == list(range(samples))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1 and min(map(len, shares)) >= 1
