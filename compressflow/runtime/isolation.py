"""Run a function in its own process, so that stopping it really stops it.

Calibration holds the model, llm-compressor's session and, on a GPU host, CUDA memory. Run in the
task's own process, a Prefect timeout or cancellation only raises in the waiting thread while
oneshot keeps running, and memory stays held until the worker exits. In a child process the
task's `finally` kills it, and the operating system returns everything it held.

The child is forked from a forkserver that imported torch, transformers and llm-compressor once
(the first run pays the ~5 s of imports; later ones start in milliseconds). It reports back over a
pipe: log records from `compressflow` loggers (re-logged in the task, so they reach the Prefect
run log), events the caller handles (calibration progress), and finally the result or the
exception with its cause and traceback text. The same launcher is where a `torchrun` start for
multi-GPU calibration would go (see the README).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from multiprocessing import spawn
from typing import Any

from compressflow.errors import CalibrationError
from compressflow.logs import run_logger

PRELOAD = ["torch", "transformers", "llmcompressor"]
KILL_GRACE_SECONDS = 10


class _PipeHandler(logging.Handler):
    def __init__(self, conn):
        super().__init__(logging.INFO)
        self.conn = conn

    def emit(self, record: logging.LogRecord) -> None:
        self.conn.send(("log", (record.levelno, record.getMessage())))


def _picklable(exc: BaseException | None) -> BaseException | None:
    if exc is None:
        return None
    try:
        pickle.dumps(exc)
        return exc
    except Exception:  # a library exception that cannot cross processes: keep its text
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _child(target: Callable, args: tuple, environment: dict[str, str], conn) -> None:
    # The forkserver's environment is the one it started with; the task's may have changed since.
    os.environ.clear()
    os.environ.update(environment)
    logger = logging.getLogger("compressflow")
    logger.addHandler(_PipeHandler(conn))
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        result = target(*args, events=lambda kind, payload=None: conn.send((kind, payload)))
        conn.send(("result", result))
    except BaseException as exc:  # everything goes back to the task, which decides
        conn.send(("error", (_picklable(exc), _picklable(exc.__cause__), traceback.format_exc())))
    finally:
        conn.close()


def _context(target: Callable):
    # The target's own module too, so a child starts with nothing left to import. Only the first
    # call's list counts: the forkserver then runs for the life of this process.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*PRELOAD, target.__module__])
    return context


def warm_up(target: Callable) -> None:
    """Start the forkserver now, so its imports overlap the stages that run before calibration.

    Its ~6 s of imports would otherwise start when calibration does. `target` is the function
    `run_isolated` will run.
    """
    from multiprocessing import forkserver

    _context(target)
    with _main_script_not_rerun():
        forkserver.ensure_running()


@contextmanager
def _main_script_not_rerun():
    """Start children without re-running the parent's main script.

    multiprocessing re-imports a `python script.py` parent's script in each child, which runs a
    script without an `if __name__ == "__main__":` guard (one that calls compress at top level)
    again inside the calibration process. The child needs nothing from it: leave it out.
    """
    original = spawn.get_preparation_data

    def preparation_data(name):
        data = original(name)
        data.pop("init_main_from_path", None)
        return data

    spawn.get_preparation_data = preparation_data
    try:
        yield
    finally:
        spawn.get_preparation_data = original


def run_isolated(
    target: Callable, args: tuple, on_event: Callable[[str, Any], None], what: str
) -> Any:
    """`target(*args, events=...)` in a child process; its result, or its exception re-raised.

    `target` and `args` must pickle (module-level function, pydantic results). Whatever ends the
    wait (the result, an error, a timeout or cancellation raised here) the child is gone after.
    """
    context = _context(target)
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(
        target=_child, args=(target, args, dict(os.environ), sender), name=what
    )
    with _main_script_not_rerun():
        process.start()
    sender.close()
    log = run_logger(__name__)
    try:
        while True:
            # Poll, not a blocking recv: a timeout or cancellation raised into this thread
            # must find it running Python, not waiting inside a read.
            if not receiver.poll(0.5):
                continue
            try:
                kind, payload = receiver.recv()
            except EOFError:  # the child died without a word: killed (out of memory?)
                process.join(KILL_GRACE_SECONDS)
                raise CalibrationError(
                    "calibration",
                    f"the {what} process exited with code {process.exitcode} before it finished "
                    "(-9 is a kill, usually the kernel's out-of-memory killer)",
                    "lower calibration.max_cpu_memory_gb so the memory plan leaves more room, or "
                    "run on a worker with more memory",
                ) from None
            if kind == "result":
                return payload
            if kind == "error":
                exc, cause, text = payload
                log.error("%s failed in its process:\n%s", what, text)
                raise exc from cause
            if kind == "log":
                log.log(*payload)
            else:
                on_event(kind, payload)
    finally:
        receiver.close()
        if process.is_alive():
            process.terminate()
            process.join(KILL_GRACE_SECONDS)
        if process.is_alive():
            process.kill()
        process.join()
