"""A real Prefect stack for end-to-end tests, set up by the README's own commands.

The README's "Deployments" section marks its command blocks with `<!-- deploy-commands: KIND -->`
comments (GitHub does not render them); `readme_commands` reads them, so the README and the tests
cannot drift. Each block is run as a user runs it, from the repository root, with PREFECT_HOME,
PREFECT_API_URL and COMPRESSFLOW_OUTPUT_DIR pointing at this test's server and folders:

- `server`: its lines verbatim (the server's settings), then its last line, `prefect server
  start`, the one line not run verbatim: it gets `--host 127.0.0.1 --port <free port>` appended,
  so tests never collide with a user's server on 4200. The environment's PREFECT_API_URL
  overrides the profile that the `setup` block's `prefect config set` line writes, so that line
  runs verbatim against this PREFECT_HOME.
- `setup`: every line verbatim, each in its own `bash -c` (as pasted one by one: no line may rely
  on another's shell state); each must exit 0.
- `workers`: every line verbatim, in the background, until the stack closes.

Every process runs in its own process group and is stopped when the stack closes, whatever
happened. One stack serves the whole test session (conftest's `prefect_stack`): about 40 s, started in the
background when collection ends (`StackInBackground`).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DEPLOY_BLOCK = re.compile(r"<!-- deploy-commands: (\w+)\b[^>]*-->\s*```bash\n(.*?)```", re.S)
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
STOP_GRACE_SECONDS = 5  # for the server and the workers together, then SIGKILL


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
        """Signals every process at once, then waits for them together, 5 s in all: one after
        another, each with a 15 s grace, the server and two workers could hold the session's end
        for 45 s (the teardown is billed to a worker's last test, on make test's critical path)."""
        for process, signum in self.processes:
            if process.poll() is None:
                with suppress(ProcessLookupError):
                    os.killpg(process.pid, signum)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for process, _ in self.processes:
            with suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(deadline - time.monotonic(), 0))
            with suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # flow-run children left in the group
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


def wait_polling(stack: Stack, worker: subprocess.Popen, pool: str, timeout: float = 90) -> None:
    """Until the server lists a worker polling `pool` (a worker line that fails exits instead)."""
    request = urllib.request.Request(
        f"{stack.api_url}/work_pools/{pool}/workers/filter", data=b"{}", method="POST"
    )
    request.add_header("Content-Type", "application/json")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert worker.poll() is None, f"the {pool} worker exited\n" + stack.tail(f"worker-{pool}")
        with urllib.request.urlopen(request, timeout=5) as response:
            if json.loads(response.read()):
                return
        time.sleep(1)
    pytest.fail(f"no worker polls {pool}\n" + stack.tail(f"worker-{pool}"))


def readme_commands(readme: Path = README) -> dict[str, list[str]]:
    """The command lines of each `<!-- deploy-commands: KIND -->` block under "## Deployments"."""
    text = readme.read_text()
    section = text[text.index("\n## Deployments\n") :]
    section = section[: section.find("\n## ", 1)]  # up to the next level-2 heading
    blocks: dict[str, list[str]] = {}
    for kind, body in DEPLOY_BLOCK.findall(section):
        lines = [line.strip() for line in body.replace("\\\n", " ").splitlines()]  # joins \ lines
        blocks[kind] = [line for line in lines if line and not line.startswith("#")]
    return blocks


@contextmanager
def running_stack(home: Path) -> Iterator[Stack]:
    """The README's deploy commands against a fresh server; everything stopped after."""
    commands = readme_commands()
    assert set(commands) == {"server", "setup", "workers"}, f"README blocks: {sorted(commands)}"
    assert all(commands.values()), f"an empty deploy-commands block in README.md: {commands}"
    assert (ROOT / ".venv" / "bin" / "prefect").exists(), (
        "the README's commands need .venv: make test"
    )
    *server_settings, server_command = commands["server"]
    api_url = f"http://127.0.0.1:{free_port()}/api"
    env = {
        **os.environ,  # conftest's offline settings: CLEARML_OFFLINE_MODE, HF_HUB_OFFLINE, caches
        "PREFECT_HOME": str(home / "home"),
        "PREFECT_API_URL": api_url,
        "PREFECT_UI_API_URL": api_url,  # the server's UI calls this API, not 4200's
        "COMPRESSFLOW_OUTPUT_DIR": str(home / "outputs"),  # what `register` saves in the block
        # A user's default (conftest turns it off for in-process flows): `--watch` shows run logs.
        "PREFECT_LOGGING_TO_API_ENABLED": "true",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_WORKER_PREFETCH_SECONDS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    stack = Stack(api_url=api_url, env=env, logs=home)
    try:
        for line in server_settings:
            stack.run("bash", "-c", line)
        host, port = api_url.split("//")[1].split("/")[0].split(":")
        server_args = [*shlex.split(server_command, comments=True), "--host", host, "--port", port]
        server = stack.start("server", *server_args)
        wait_healthy(stack, server)
        for line in commands["setup"]:
            stack.run("bash", "-c", line, timeout=300)
        workers = {}  # all started, then waited for: their start-ups overlap
        for line in commands["workers"]:
            pool = re.search(r"--pool\s+(\S+)", line).group(1)
            # The worker ignores SIGTERM: it gets SIGINT.
            workers[pool] = stack.start(
                f"worker-{pool}", "bash", "-c", line, stop_with=signal.SIGINT
            )
        for pool, worker in workers.items():
            wait_polling(stack, worker, pool)
        yield stack
    finally:
        stack.stop_all()


class StackInBackground:
    """`running_stack` entered on a thread of its own, from the moment collection ends: its ~40 s
    of server start, setup commands and workers (all subprocesses) overlap the tests that run
    before the first one that needs it (the unit tier, the architecture matrix)."""

    def __init__(self, home: Path) -> None:
        self._context = running_stack(home)
        self._stack: Stack | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._enter, name="prefect-stack", daemon=True)
        self._thread.start()

    def _enter(self) -> None:
        try:
            self._stack = self._context.__enter__()
        except BaseException as exc:  # pytest.fail's too: raised again in the test that waits
            self._error = exc

    def wait(self) -> Stack:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._stack

    def close(self) -> None:
        """Stops everything it started; again, or when the start failed, nothing."""
        self._thread.join()
        if self._stack is not None and not self._closed:
            self._closed = True
            self._context.__exit__(None, None, None)


def cli(stack: Stack, *command: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """A command as a user types it, in the stack's environment; never raises on failure."""
    return subprocess.run(
        command, cwd=cwd, env=stack.env, capture_output=True, text=True, timeout=300
    )


def wait_final(client, stack: Stack, flow_run_id, timeout: float):
    """The flow run once it is final (completed, failed, crashed, cancelled)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = client.read_flow_run(flow_run_id)
        if run.state and run.state.type.value in FINAL:
            return run
        time.sleep(1)
    pytest.fail(
        f"flow run {flow_run_id} did not finish in {timeout} s\n" + stack.tail("worker-gpu")
    )
