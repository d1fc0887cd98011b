"""GPU slots against the real Prefect stack: the compress deployment's runs, on the process worker.

No GPU here: each run's job variables pretend its host has GPUs (COMPRESSFLOW_GPU_DEVICES) and
give this test slot names of its own (COMPRESSFLOW_GPU_SLOT_PREFIX), so other tests' runs on the
same server never share them. When a run holds a slot and when it gave it back come from its
Prefect run log ("Calibrating on ..." / "Released ..."), written by the calibrate task. Three
tiny compress runs: about two minutes on two busy cores.
"""

from __future__ import annotations

import time
import uuid
from datetime import datetime

import pytest
from support.prefect_stack import wait_final


@pytest.fixture
def client(stack_client):
    return stack_client


def submit(client, tiny_model, tmp_path, env, name, deployment="compress-model/compress"):
    deployment = client.read_deployment_by_name(deployment)
    parameters = {
        "model": {"model_id": str(tiny_model)},
        "dataset": {"dataset_name": "python_docs", "text_samples": 8, "max_seq_len": 32},
        "recipe": {"preset": "W4A16"},
        # Folders of their own: one output's lock would line them up without any slot.
        "output": {"save_directory": str(tmp_path / name), "auto_evaluate": False},
    }
    return client.create_flow_run_from_deployment(
        deployment.id, parameters=parameters, job_variables={"env": env}
    )


def slot_log(client, flow_run_id) -> dict[str, tuple[datetime, str]]:
    """{"Calibrating"/"Released"/"Waiting": (when, message)} from the run's log."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    logs = client.read_logs(
        log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
    )
    found = {}
    for entry in logs:
        word = entry.message.split(" ", 1)[0]
        if word in ("Calibrating", "Released", "Waiting") and word not in found:
            found[word] = (entry.timestamp, entry.message)
    return found


def completed(client, prefect_stack, run):
    run = wait_final(client, prefect_stack, run.id, timeout=300)
    assert run.state.is_completed(), f"{run.name} ended {run.state}\n" + prefect_stack.tail(
        "worker-gpu"
    )
    # The run's logs reach the API in batches, and may land after its final state (on a busy
    # machine, every line of it: its "Calibrating" too). Every run here calibrates on a pretend
    # GPU and says "Released" before verify and publish, which take a few seconds.
    deadline = time.monotonic() + 30
    while "Released" not in (log := slot_log(client, run.id)) and time.monotonic() < deadline:
        time.sleep(1)
    return log


def test_two_runs_on_a_one_gpu_host_calibrate_one_after_the_other(
    client, prefect_stack, tiny_model, tmp_path, monkeypatch
):
    from prefect.concurrency.sync import concurrency
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from compressflow.runtime.gpus import ensure_limits

    prefix = f"{uuid.uuid4()}:"
    monkeypatch.setenv("COMPRESSFLOW_GPU_SLOT_PREFIX", prefix)  # for ensure_limits, here
    env = {"COMPRESSFLOW_GPU_DEVICES": "0", "COMPRESSFLOW_GPU_SLOT_PREFIX": prefix}
    with temporary_settings({PREFECT_API_URL: prefect_stack.api_url}):
        ensure_limits(["0"])
        # Held until both runs wait for it: then they want the one GPU at the same time.
        with concurrency(f"{prefix}gpu:0", strict=True):
            # Two deployments: each has a deployment concurrency limit of 1 of its own.
            runs = [
                submit(client, tiny_model, tmp_path, env, "one"),
                submit(client, tiny_model, tmp_path, env, "two", "compress-model/nightly-w4a16"),
            ]
            deadline = time.monotonic() + 240
            while not all("Waiting" in slot_log(client, run.id) for run in runs):
                assert time.monotonic() < deadline, prefect_stack.tail("worker-gpu")
                time.sleep(2)
    first, second = sorted(
        (completed(client, prefect_stack, run) for run in runs),
        key=lambda log: log["Calibrating"][0],
    )
    assert first["Waiting"][1] == f"Waiting for 1 free slot(s) of {prefix}gpu:0 (no limit)"
    for log in (first, second):
        assert log["Calibrating"][1] == f"Calibrating on {prefix}gpu:0 (CUDA_VISIBLE_DEVICES=0)"
    # The second took the slot after the first gave it back: their windows do not overlap.
    assert second["Calibrating"][0] >= first["Released"][0], (first, second)


def test_a_run_takes_the_free_gpu_while_another_is_held(
    client, prefect_stack, tiny_model, tmp_path, monkeypatch
):
    from prefect.concurrency.sync import concurrency
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from compressflow.runtime.gpus import ensure_limits

    prefix = f"{uuid.uuid4()}:"
    monkeypatch.setenv("COMPRESSFLOW_GPU_SLOT_PREFIX", prefix)  # for ensure_limits, here
    env = {"COMPRESSFLOW_GPU_DEVICES": "0,1", "COMPRESSFLOW_GPU_SLOT_PREFIX": prefix}
    with temporary_settings({PREFECT_API_URL: prefect_stack.api_url}):
        ensure_limits(["0", "1"])
        with concurrency(f"{prefix}gpu:0", strict=True):  # as another run calibrating on gpu:0
            log = completed(client, prefect_stack, submit(client, tiny_model, tmp_path, env, "b"))
    assert log["Calibrating"][1] == f"Calibrating on {prefix}gpu:1 (CUDA_VISIBLE_DEVICES=1)"
    assert "Waiting" not in log  # a free one was there: it did not wait for gpu:0
