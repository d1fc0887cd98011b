"""prefect.yaml end to end, the way a user runs it: a real server, a process pool, a worker.

One module-scoped set-up does what the README's "Deployments" section tells a user to do, against
a `prefect server` on 127.0.0.1 with its own PREFECT_HOME: create the `gpu` process pool, register
the blocks, `prefect --no-prompt deploy --all`, start a worker with `--limit 1`. The test then
runs the compress deployment on the tiny model and waits for the evaluate deployment, started by
the `compressflow.model.published` event, to complete with its metrics. Every process started here
runs in its own process group and is stopped in the fixture's teardown, whatever happened.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).parent / "prefect")
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Stack:
    """The server's URL, the environment every command gets, and the processes to stop."""

    api_url: str
    env: dict[str, str]
    logs: Path
    processes: list[tuple[subprocess.Popen, signal.Signals]] = field(default_factory=list)

    def start(self, name: str, *args: str, stop_with: signal.Signals = signal.SIGTERM):
        log = (self.logs / f"{name}.log").open("w")
        process = subprocess.Popen(
            args, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: teardown reaches its children
        )  # fmt: skip
        self.processes.append((process, stop_with))
        return process

    def run(self, *args: str, timeout: float = 120) -> str:
        done = subprocess.run(
            args,
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert done.returncode == 0, f"{' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def tail(self, name: str, lines: int = 60) -> str:
        text = (self.logs / f"{name}.log").read_text(errors="replace").splitlines()
        return f"--- {name} log (last {lines} lines) ---\n" + "\n".join(text[-lines:])

    def stop_all(self) -> None:
        for process, signum in reversed(self.processes):
            if process.poll() is None:
                os.killpg(process.pid, signum)  # the worker ignores SIGTERM: it gets SIGINT
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
            try:
                os.killpg(process.pid, signal.SIGKILL)  # flow-run children left in the group
            except ProcessLookupError:
                pass
            process.wait(timeout=10)


def wait_healthy(stack: Stack, server: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, "prefect server exited\n" + stack.tail("server")
        try:
            with urllib.request.urlopen(f"{stack.api_url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail("prefect server did not become healthy\n" + stack.tail("server"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-e2e")
    api_url = f"http://127.0.0.1:{free_port()}/api"
    env = {
        **os.environ,  # conftest's offline settings: CLEARML_OFFLINE_MODE, HF_HUB_OFFLINE, caches
        "PREFECT_HOME": str(home / "home"),
        "PREFECT_API_URL": api_url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_WORKER_PREFETCH_SECONDS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    stack = Stack(api_url=api_url, env=env, logs=home)
    try:
        host, port = api_url.split("//")[1].split("/")[0].split(":")
        server = stack.start("server", PREFECT, "server", "start", "--host", host, "--port", port)
        wait_healthy(stack, server)
        stack.run(PREFECT, "work-pool", "create", "gpu", "--type", "process")
        stack.run(sys.executable, "-m", "blocks.register", "--output-dir", str(home / "outputs"))
        stack.run(PREFECT, "--no-prompt", "deploy", "--all", timeout=240)
        stack.start("worker", PREFECT, "worker", "start", "--pool", "gpu", "--limit", "1",
                    stop_with=signal.SIGINT)  # fmt: skip
        yield stack
    finally:
        stack.stop_all()


@pytest.fixture
def client(stack):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with (
        temporary_settings({PREFECT_API_URL: stack.api_url}),
        get_client(sync_client=True) as client,
    ):
        yield client


def wait_final(client, stack: Stack, flow_run_id, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = client.read_flow_run(flow_run_id)
        if run.state and run.state.type.value in FINAL:
            return run
        time.sleep(1)
    pytest.fail(f"flow run {flow_run_id} did not finish in {timeout} s\n" + stack.tail("worker"))


def wait_triggered_run(client, stack: Stack, deployment_id, timeout: float):
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
        )
        if runs:
            return wait_final(client, stack, runs[0].id, max(deadline - time.monotonic(), 1))
        time.sleep(1)
    pytest.fail("the published event did not start evaluate-model\n" + stack.tail("server"))


def test_prefect_yaml_deploys_presets_limits_and_blocks(stack, client):
    nightly = client.read_deployment_by_name("compress-model/nightly-w4a16")
    assert [s.active for s in nightly.schedules] == [False], "the nightly must ship inactive"
    assert nightly.parameters["recipe"]["recipe"] == "W4A16"
    for name in ("compress-model/compress", "compress-model/w8a8", "compress-model/fp8-dynamic",
                 "evaluate-model/evaluate"):  # fmt: skip
        deployment = client.read_deployment_by_name(name)
        assert deployment.work_pool_name == "gpu"
        assert deployment.global_concurrency_limit.limit == 1
        env = deployment.job_variables["env"]
        # Resolved from the OutputSettings block that `python -m blocks.register` saved.
        assert env["COMPRESSFLOW_OUTPUT_DIR"] == str(stack.logs / "outputs")
        assert env["CUDA_VISIBLE_DEVICES"] == "0"


def test_deployment_rejects_bad_parameters_before_any_run(stack, client, tiny_model):
    from prefect.exceptions import PrefectHTTPStatusError

    deployment = client.read_deployment_by_name("compress-model/compress")
    assert deployment.enforce_parameter_schema
    bad = {"model": {"model_id": str(tiny_model)}, "dataset": {"text_samples": -1}}
    runs_before = len(client.read_flow_runs())
    with pytest.raises(PrefectHTTPStatusError) as refused:
        client.create_flow_run_from_deployment(deployment.id, parameters=bad)
    assert refused.value.response.status_code in (409, 422)
    assert "text_samples" in refused.value.response.text
    assert len(client.read_flow_runs()) == runs_before, "a run was created for bad parameters"


def test_compress_deployment_publishes_and_triggers_evaluation(stack, client, tiny_model, tmp_path):
    started = time.monotonic()
    compress_deployment = client.read_deployment_by_name("compress-model/compress")
    evaluate_deployment = client.read_deployment_by_name("evaluate-model/evaluate")
    target = tmp_path / "tiny-w4a16"
    parameters = {
        "model": {"model_id": str(tiny_model)},
        "dataset": {"dataset_name": "python_docs", "text_samples": 16, "max_seq_len": 64},
        "recipe": {"recipe": "W4A16"},
        "output": {"save_directory": str(target), "tags": ["e2e"]},
    }
    run = client.create_flow_run_from_deployment(compress_deployment.id, parameters=parameters)
    run = wait_final(client, stack, run.id, timeout=180)
    assert run.state.is_completed(), f"compress-model ended {run.state}\n" + stack.tail("worker")
    assert (target / "manifest.json").exists()

    evaluation = wait_triggered_run(client, stack, evaluate_deployment.id, timeout=180)
    assert evaluation.state.is_completed(), (
        f"evaluate-model ended {evaluation.state}\n" + stack.tail("worker")
    )
    # Filled in by the trigger from the event's payload.
    assert evaluation.parameters["compressed"] == {"model_id": str(target)}
    assert evaluation.parameters["base"]["model_id"] == str(tiny_model)

    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )

    artifacts = client.read_artifacts(
        artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[evaluation.id]),
            key=ArtifactFilterKey(any_=["evaluation-metrics"]),
        )
    )
    assert len(artifacts) == 1
    rows = {row["metric"]: row for row in json.loads(artifacts[0].data)}
    perplexity = rows["perplexity"]
    assert math.isfinite(perplexity["base"]) and math.isfinite(perplexity["compressed"])
    assert rows["KL(base || compressed), nats/token"]["compressed"] >= 0
    print(f"compress -> evaluate through the deployments: {time.monotonic() - started:.1f} s")
