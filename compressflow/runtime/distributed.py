"""Start a calibration on several GPUs: one process per device under torchrun, watched like one.

llm-compressor's distributed oneshot runs one rank per GPU, each started by `torchrun
--nproc_per_node N`. This launcher writes the job (function and arguments, pickled) into a private
folder, starts torchrun on compressflow.runtime.rank, and listens on a socket there: each rank
says hello, then sends its log records (re-logged here as `[rank N] ...`, so they reach the
Prefect run log), its events (rank 0's drive the progress artifact) and its end. Rank 0's result
is the calibration's. A rank that dies without a result (an exit code, a signal) fails the run
with a CalibrationError naming the rank and its last words (the tail of DIR/rank-N.log); the other
ranks and torchrun are stopped, whatever ends the wait, and the folder is removed.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Listener, wait
from pathlib import Path
from typing import Any

from compressflow.errors import CalibrationError
from compressflow.logs import run_logger
from compressflow.runtime.isolation import KILL_GRACE_SECONDS, _died, _ended, _Tail

# torchrun's summary of a failed worker: "rank : 1 (local_rank: 1)" then "exitcode : -9 (pid: ..)"
_ROOT_CAUSE = re.compile(r"rank\s*:\s*(\d+).*?\n\s*exitcode\s*:\s*(-?\d+)", re.S)


def torchrun_command(gpus: int, folder: Path) -> list[str]:
    """torchrun (as `python -m torch.distributed.run`, this environment's) on our rank entry.

    --standalone: a rendezvous on a free local port, so two runs on one host never meet.
    """
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={gpus}",
        "-m",
        "compressflow.runtime.rank",
        str(folder),
    ]


def torchrun_environment(devices: list[str]) -> dict[str, str]:
    """This process's environment, with the devices the ranks may use (rank N takes the Nth)."""
    environment = dict(os.environ)
    if devices:
        environment["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    return environment


class _Rank:
    def __init__(self, number: int, pid: int, folder: Path):
        self.number = number
        self.pid = pid
        self.log = open(folder / f"rank-{number}.log", "rb")  # noqa: SIM115 (closed in the finally)
        self.tail = _Tail()
        self.done = False  # sent its result, error or end

    def read(self) -> None:
        """What the rank printed since the last read, copied on to this process's stderr."""
        self.tail.copy(self.log)


def _first_failure(torchrun_log: Path) -> tuple[int, int] | None:
    """(rank, exit code) of torchrun's "Root Cause (first observed failure)", if it wrote one."""
    text = torchrun_log.read_text(errors="replace")
    # Its "Failures:" list, before the root cause, holds the ranks it stopped (SIGTERM).
    found = _ROOT_CAUSE.search(text, max(text.find("Root Cause"), 0))
    return (int(found.group(1)), int(found.group(2))) if found else None


def run_distributed(
    target: Callable,
    args: tuple,
    gpus: int,
    devices: list[str],
    on_event: Callable[[str, Any], None],
    what: str,
) -> Any:
    """`target(*args, events=...)` in each of `gpus` ranks under torchrun; rank 0's result."""
    log = run_logger(__name__)
    folder = Path(tempfile.mkdtemp(prefix="compressflow-ranks-"))  # 0700: ours alone
    listener = process = None
    arrived: list = []  # connections accepted by the thread below
    ranks: dict[Any, _Rank] = {}
    try:
        authkey = os.urandom(32)
        listener = Listener(str(folder / "socket"), family="AF_UNIX", authkey=authkey)
        with open(folder / "job.pickle", "wb") as file:
            pickle.dump((listener.address, authkey), file)
            pickle.dump((target, args), file)
        threading.Thread(target=_accept, args=(listener, gpus, arrived), daemon=True).start()
        command = torchrun_command(gpus, folder)
        log.info("Starting %d ranks: %s", gpus, " ".join(command))
        with open(folder / "torchrun.log", "wb") as output:
            process = subprocess.Popen(
                command,
                env=torchrun_environment(devices),
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a cancellation's signal to the worker is handled here
            )
        return _watch(process, folder, gpus, arrived, ranks, on_event, what)
    finally:
        if listener is not None:
            listener.close()
        for conn in arrived:
            conn.close()
        if process is not None:
            _stop(process, [rank.pid for rank in ranks.values()], str(folder))
        for rank in ranks.values():
            rank.log.close()
        shutil.rmtree(folder, ignore_errors=True)


def _accept(listener: Listener, gpus: int, arrived: list) -> None:
    try:
        for _ in range(gpus):
            arrived.append(listener.accept())
    except OSError:  # the listener closed: the launch is over
        pass


def _watch(
    process: subprocess.Popen,
    folder: Path,
    gpus: int,
    arrived: list,
    ranks: dict,
    on_event: Callable[[str, Any], None],
    what: str,
) -> Any:
    """The ranks' messages until torchrun ends; rank 0's result, or what ended the calibration."""
    log = run_logger(__name__)
    torchrun_log = folder / "torchrun.log"
    result: list = []

    def died(number: int) -> CalibrationError:
        """A rank gone without a word: torchrun stops the others and names the first to fail."""
        try:
            process.wait(KILL_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        number, exitcode = _first_failure(torchrun_log) or (number, None)
        first = next((r for r in ranks.values() if r.number == number), None)
        if first is None:  # it died before it said hello: what it printed is in its log
            tail, printed = _Tail(), folder / f"rank-{number}.log"
            tail.add(printed.read_text(errors="replace") if printed.exists() else "")
            tail.add("\n")
            return _died(f"{what} rank {number}", exitcode, tail)
        first.read()
        first.tail.add("\n")
        return _died(f"{what} rank {first.number}", exitcode, first.tail)

    def handle(conn) -> None:
        """One message from `conn`; raises what ends the calibration."""
        rank = ranks.get(conn)
        try:
            kind, payload = conn.recv()
        except EOFError:
            conn.close()
            if rank is not None and not rank.done:
                raise died(rank.number) from None
            return
        if kind == "hello":
            number, pid = payload
            ranks[conn] = _Rank(number, pid, folder)
            return
        if kind in ("result", "error", "ended"):
            rank.done = True
            rank.read()
            rank.tail.add("\n")
        if kind == "result":
            if rank.number == 0:
                result.append(payload)
        elif kind == "error":
            exc, cause, text = payload
            log.error("%s rank %d failed in its process:\n%s", what, rank.number, text)
            raise exc from cause
        elif kind == "ended":
            how, text = payload
            log.error("%s rank %d ended in its process:\n%s", what, rank.number, text)
            raise _ended(f"{what} rank {rank.number}", how, rank.tail)
        elif kind == "log":
            log.log(payload[0], "[rank %d] %s", rank.number, payload[1])
            rank.tail.logged(payload[1])
        elif rank.number == 0:  # progress: every rank calibrates the same layers in step
            on_event(kind, payload)

    while True:
        if listening := [conn for conn in arrived if not conn.closed]:
            for conn in wait(listening, timeout=0.5):
                handle(conn)
        else:  # no rank has connected yet
            time.sleep(0.5)
        for rank in ranks.values():
            rank.read()
        if process.poll() is None:
            continue
        # torchrun is gone, and every rank with it: read what is left, then judge.
        for conn in [conn for conn in arrived if not conn.closed]:
            while not conn.closed:
                handle(conn)
        if result and process.returncode == 0:
            return result[0]
        if _first_failure(torchrun_log):  # a rank died before it said hello
            raise died(0)
        output = torchrun_log.read_text(errors="replace")[-2000:]
        raise CalibrationError(
            "calibration.gpus",
            f"torchrun exited with code {process.returncode} before every rank reported "
            f"back ({len(ranks)} of {gpus} started); its last output: {output.strip()}",
            "set calibration.gpus to 1 to calibrate in one process, or report this output",
        )


def _stop(process: subprocess.Popen, pids: list[int], folder_arg: str) -> None:
    """torchrun and every rank gone: asked first (torchrun stops its ranks), then killed."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(KILL_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    # torchrun starts each rank in a session of its own; one it could not stop is killed here,
    # if that process id is still our rank's (ids are reused).
    for pid in pids:
        try:
            if folder_arg in Path(f"/proc/{pid}/cmdline").read_text():
                os.kill(pid, signal.SIGKILL)
        except OSError:  # gone already
            pass
