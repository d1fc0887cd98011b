"""A fleet of GPU hosts against the real Prefect stack: one deployment's runs over two workers.

Two process workers of one pool stand for two hosts of two GPUs each: each is started with the
README's gpu worker line (its `--limit` counts the host's GPUs) and an environment that pretends
its GPUs (COMPRESSFLOW_GPU_DEVICES=0,1) and names its host (COMPRESSFLOW_GPU_SLOT_PREFIX, as two
real hosts' names would). The session's own gpu worker polls the `gpu` pool, so the runs go to a
pool of their own, through a copy of the compress deployment as prefect.yaml deployed it (its
deployment limit included). When a run holds a slot and when it gave it back come from its
Prefect run log ("Waiting ..." / "Holding ..." / "Released ..."), written by the flow, which
holds a run's GPUs from its calibration to the end of its verify; the server's limits say who
holds a GPU now. The runs calibrate through a collator of this module that holds their first
batch until the test has seen all four GPUs held: on two busy cores they reach their slots
seconds apart, and a tiny calibration is over in seconds. Five tiny compress runs, four at once:
80 to 150 s on two cores shared with other work.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import pytest
from support.prefect_stack import readme_commands, wait_final

HOSTS = ("host-a", "host-b")
GO = "FLEET_TEST_GO_FILE"  # the file whose existence lets the calibrations go on


def collate_after_go(batch):
    """The runs' calibration collator: holds the first batch until the test has seen every run
    hold its GPU (however long a busy machine took to get them there), then collates as usual
    (batch 1). Bounded: a test that failed first leaves no calibration hanging."""
    from transformers import default_data_collator

    deadline = time.monotonic() + 300
    while not Path(os.environ[GO]).exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return default_data_collator(batch)


@pytest.fixture
def client(stack_client):
    return stack_client


def slot_log(client, flow_run_id) -> dict[str, tuple[datetime, str]]:
    """{"Holding"/"Released"/"Waiting"/"verify": (when, message)} from the run's log, each
    word's first line ("verify": the verify stage's first check)."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    logs = client.read_logs(
        log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
    )
    found = {}
    for entry in logs:
        word = entry.message.split(" ", 1)[0]
        if word in ("Holding", "Released", "Waiting", "verify") and word not in found:
            found[word] = (entry.timestamp, entry.message)
    return found


def fleet_deployment(client, stack, pool: str):
    """The compress deployment, copied as prefect.yaml deployed it, onto the pool `pool`."""
    compress = client.read_deployment_by_name("compress-model/compress")
    limit = compress.global_concurrency_limit
    stack.run(".venv/bin/prefect", "work-pool", "create", pool, "--type", "process")
    return client.create_deployment(
        flow_id=compress.flow_id,
        name=pool,
        work_pool_name=pool,
        entrypoint=compress.entrypoint,
        path=compress.path,
        pull_steps=compress.pull_steps,
        parameter_openapi_schema=compress.parameter_openapi_schema,
        enforce_parameter_schema=compress.enforce_parameter_schema,
        job_variables=compress.job_variables,
        concurrency_limit=limit.limit if limit else None,
        concurrency_options=compress.concurrency_options,
    )


@contextmanager
def hosts(stack, pool: str, prefixes: dict[str, str], go: Path) -> Iterator[None]:
    """Each host's worker: the README's gpu line, on `pool`, in that host's environment; from
    when both poll the pool until they are stopped. Their runs may use `collate_after_go`."""
    (line,) = [line for line in readme_commands()["workers"] if "--pool gpu " in line]
    line = line.replace("--pool gpu ", f"--pool {pool} ")
    here = Path(__file__).parent
    runs_env = {
        "PYTHONPATH": f"{here}:{here.parent}",  # this module, and the `support` it imports
        "COMPRESSFLOW_ALLOWED_IMPORTS": f"{os.environ['COMPRESSFLOW_ALLOWED_IMPORTS']},{__name__}",
        GO: str(go),
    }
    workers = []
    try:
        for host, prefix in prefixes.items():
            env = {**runs_env, "COMPRESSFLOW_GPU_DEVICES": "0,1"}
            env["COMPRESSFLOW_GPU_SLOT_PREFIX"] = prefix  # as two real hosts' names would
            # Exported: the line's `--limit "$(...)"` must see the host's GPUs too.
            exports = " ".join(f"{name}={shlex.quote(value)}" for name, value in env.items())
            workers.append(stack.start(f"worker-{host}", "bash", "-c", f"export {exports}; {line}"))
        request = urllib.request.Request(
            f"{stack.api_url}/work_pools/{pool}/workers/filter", data=b"{}", method="POST"
        )
        request.add_header("Content-Type", "application/json")
        deadline = time.monotonic() + 120
        while len(json.loads(urllib.request.urlopen(request, timeout=5).read())) < len(prefixes):
            assert time.monotonic() < deadline, tails(stack)
            time.sleep(1)
        yield
    finally:
        for worker in workers:  # the worker ignores SIGTERM
            os.killpg(worker.pid, signal.SIGINT)
        for worker in workers:
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)


def tails(stack) -> str:
    return "\n".join(stack.tail(f"worker-{host}") for host in HOSTS)


def test_five_runs_of_one_deployment_on_two_hosts_of_two_gpus_calibrate_four_at_once(
    client, prefect_stack, tiny_model, tmp_path, monkeypatch
):
    from prefect.client.schemas.objects import StateType
    from prefect.concurrency.sync import concurrency
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from compressflow.runtime.gpus import ensure_limits

    tag = uuid.uuid4().hex[:8]  # the session's server outlives this test: names of its own
    pool = f"fleet-{tag}"
    prefixes = {host: f"{host}-{tag}:" for host in HOSTS}
    slots = [f"{prefix}gpu:{device}" for prefix in prefixes.values() for device in "01"]
    go = tmp_path / "go"
    parameters = {
        "model": {"model_id": str(tiny_model)},
        "dataset": {
            "dataset_name": "python_docs",
            "text_samples": 8,
            "max_seq_len": 32,
            "data_collator": f"{__name__}:collate_after_go",
        },
        "recipe": {"preset": "W4A16"},
        "calibration": {"batch_size": 1, "threads": 1},  # four calibrations share two cores
        "tracking": {"enabled": False},  # ClearML has nothing to do with slots
    }
    deployment_id = fleet_deployment(client, prefect_stack, pool)

    def submit(n: int):
        # Folders of their own: one output's lock would line them up without any slot.
        output = {"save_directory": str(tmp_path / str(n)), "auto_evaluate": False}
        return client.create_flow_run_from_deployment(
            deployment_id, parameters={**parameters, "output": output}
        )

    def until(condition, what: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"{what} within {timeout} s\n" + tails(
                prefect_stack
            )
            time.sleep(1)

    def held_by_runs() -> int:
        limits = [client.read_global_concurrency_limit_by_name(slot) for slot in slots]
        return sum(limit.active_slots for limit in limits)

    with (
        hosts(prefect_stack, pool, prefixes, go),
        temporary_settings({PREFECT_API_URL: prefect_stack.api_url}),
    ):
        for prefix in prefixes.values():
            monkeypatch.setenv("COMPRESSFLOW_GPU_SLOT_PREFIX", prefix)
            ensure_limits(["0", "1"])
        # Every GPU of the fleet held here while five runs are submitted at once: the runs that
        # fit go as far as their slot and wait for it.
        with concurrency(slots, strict=True):
            runs = [submit(n) for n in range(5)]
            until(
                lambda: sum("Waiting" in slot_log(client, run.id) for run in runs) == 4,
                "four runs did not wait for a GPU",
            )
        # Released: the four take a GPU each and calibrate until `go` exists.
        until(lambda: held_by_runs() == 4, "the four runs did not hold the four GPUs at once")
        (fifth,) = [run for run in runs if "Waiting" not in slot_log(client, run.id)]
        # Both hosts full (a run per GPU): the fifth waits in the pool's queue, not on a host.
        assert client.read_flow_run(fifth.id).state.type == StateType.SCHEDULED
        go.touch()
        logs = {}
        for run in runs:
            final = wait_final(client, prefect_stack, run.id, timeout=300)
            assert final.state.is_completed(), f"{final.name} ended {final.state}\n" + tails(
                prefect_stack
            )
            # Logs reach the API in batches, possibly after the final state.
            until(lambda: "Released" in slot_log(client, run.id), "no Released line", 30)  # noqa: B023
            logs[run.id] = slot_log(client, run.id)
    four = [logs[run.id] for run in runs if run.id != fifth.id]
    # Two runs per host, each waiting for its own host's GPUs, then one GPU each.
    assert sorted(log["Waiting"][1] for log in four) == sorted(
        f"Waiting for 1 free slot(s) of {prefix}gpu:0, {prefix}gpu:1 (no limit)"
        for prefix in prefixes.values()
        for _ in "01"
    )
    held = sorted(log["Holding"][1].split(" ")[1] for log in four)
    assert held == sorted(slots), held
    # All four held their GPUs at the same time: the last took its slot before any released.
    assert max(log["Holding"][0] for log in four) < min(log["Released"][0] for log in four)
    # Verify ran on the run's own GPU: its checks were logged before the slot went back.
    assert all(log["verify"][0] < log["Released"][0] for log in logs.values())
    assert all("for calibration and verification" in log["Holding"][1] for log in logs.values())
    # The fifth calibrated only once one of them had given its GPU back, on the host it freed.
    assert "Waiting" not in logs[fifth.id]
    assert logs[fifth.id]["Holding"][0] >= min(log["Released"][0] for log in four)
