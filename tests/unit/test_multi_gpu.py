"""GPU hosts: which devices a host has, the refusal of too few, and the torchrun launch of ranks.

There is no GPU here: COMPRESSFLOW_GPU_DEVICES pretends a host has some. The launch command and
environment are checked here; tests/matrix/test_torchrun_ranks.py runs a real torchrun with two
CPU ranks.
"""

from __future__ import annotations

import os
import socket
import sys

import pytest

from compressflow.errors import CalibrationError
from compressflow.runtime import gpus
from compressflow.runtime.distributed import torchrun_command, torchrun_environment


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
    monkeypatch.setenv("COMPRESSFLOW_GPU_SLOT_PREFIX", "")  # the operator's choice: shared names
    assert gpus.slot_name("2") == "gpu:2"
    monkeypatch.delenv("COMPRESSFLOW_GPU_SLOT_PREFIX")  # per host by default
    assert gpus.slot_name("2") == f"{socket.gethostname()}:gpu:2"


def test_a_worker_takes_one_run_per_gpu_and_one_on_a_cpu_host(monkeypatch):
    monkeypatch.setenv("COMPRESSFLOW_GPU_DEVICES", "0,1,2")
    assert gpus.worker_limit() == 3
    monkeypatch.setenv("COMPRESSFLOW_GPU_DEVICES", "none")
    assert gpus.worker_limit() == 1


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


def visible_devices() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def test_while_a_run_holds_gpus_every_child_sees_only_those(monkeypatch):
    """Verify's reload (device_map="auto"), vLLM (the first visible GPU) and the search's
    perplexity run in children of their own: held for the run, the GPUs they see are its own,
    not one another run calibrates on. The calibrate task inside the flow's hold asks again and
    gets the same devices, without a second slot (one slot of a limit of 1: it would wait on
    itself)."""
    from compressflow.runtime.isolation import in_child

    monkeypatch.setenv("COMPRESSFLOW_GPU_DEVICES", "0,1,2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    monkeypatch.setenv(gpus.HELD, "1,2")  # held already: no server is asked
    with gpus.gpu_slots(2, None) as nested:
        assert nested == ["1", "2"]
    monkeypatch.delenv(gpus.HELD)
    monkeypatch.setenv("COMPRESSFLOW_GPU_SLOTS", "false")  # a pod's GPUs: no server here either
    with gpus.gpu_slots(2, None) as held:
        assert held == ["0", "1"]
        assert in_child(visible_devices) == "0,1"
        with gpus.gpu_slots(2, None) as again:
            assert again == held
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2" and gpus.HELD not in os.environ
    assert in_child(visible_devices) == "0,1,2"


@pytest.mark.parametrize(("samples", "world"), [(8, 2), (10, 4), (3, 3), (512, 7)])
def test_each_rank_calibrates_on_its_own_share_of_the_samples(samples, world):
    """llm-compressor reduces the statistics across ranks: the shares cover every sample once,
    and differ in size by one at most."""
    from compressflow.calibration.ranks import rank_share

    shares = [rank_share(samples, rank, world) for rank in range(world)]
    assert [i for share in shares for i in share] == list(range(samples))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1 and min(map(len, shares)) >= 1
