"""A real Prefect stack for end-to-end tests: `prefect server`, process pools, a worker.

It does what the README's "Deployments" section tells a user to do, against a `prefect server`
on 127.0.0.1 with its own PREFECT_HOME: create the `gpu` (and `cpu`) process pools, register the
blocks, `prefect --no-prompt deploy --all`, start a worker with `--limit 1`. Every process runs in
its own process group and is stopped when the stack closes, whatever happened. One stack serves
the whole test session (conftest's `prefect_stack`): starting one costs about 30 s.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
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
            args,
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: teardown reaches its children
        )
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


@contextmanager
def running_stack(home: Path) -> Iterator[Stack]:
    """What the README tells a user to do, against a fresh server; everything stopped after."""
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
        stack.run(PREFECT, "work-pool", "create", "cpu", "--type", "process")  # sweeps wait here
        stack.run(
            sys.executable,
            "-m",
            "compressflow.blocks.register",
            "--output-dir",
            str(home / "outputs"),
        )
        stack.run(PREFECT, "--no-prompt", "deploy", "--all", timeout=240)
        stack.start(
            "worker",
            PREFECT,
            "worker",
            "start",
            "--pool",
            "gpu",
            "--limit",
            "1",
            stop_with=signal.SIGINT,
        )
        yield stack
    finally:
        stack.stop_all()


def wait_final(client, stack: Stack, flow_run_id, timeout: float):
    """The flow run once it is final (completed, failed, crashed, cancelled)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = client.read_flow_run(flow_run_id)
        if run.state and run.state.type.value in FINAL:
            return run
        time.sleep(1)
    pytest.fail(f"flow run {flow_run_id} did not finish in {timeout} s\n" + stack.tail("worker"))
