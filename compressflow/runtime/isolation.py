"""Run a function in its own process, so that stopping it really stops it, and so that the
flow's own process never imports torch, transformers or llm-compressor.

Calibration holds the model, llm-compressor's session and, on a GPU host, CUDA memory. Run in the
task's own process, a Prefect timeout or cancellation only raises in the waiting thread while
oneshot keeps running, and memory stays held until the worker exits. In a child process the
task's `finally` kills it, and the operating system returns everything it held.

The child is forked from a forkserver that imported torch, transformers and llm-compressor once
(the first run pays the ~5 s of imports; later ones start in milliseconds). It reports back over a
pipe: log records from `compressflow` loggers (re-logged in the task, so they reach the Prefect
run log), events the caller handles (calibration progress), and finally the result or the
exception with its cause and traceback text. Its stderr (fd 2) comes back over a second pipe and is
copied to the task's, keeping a short tail: libraries end the process themselves (auto-round calls
`sys.exit(-1)`, a native crash aborts, the kernel's OOM killer sends SIGKILL), and that tail, their
last words, goes into the CalibrationError that such an end becomes. A multi-GPU calibration's
ranks, started by torchrun (compressflow.runtime.distributed), speak the same protocol (`serve`).

Every stage that needs those libraries (rendering a recipe, building the dataset, the memory plan,
tracing, calibration, verification) does that part through `in_child`: the task's process keeps
Prefect, ClearML and the results, about 0.3 GB, and the libraries and weights live in children
that share the forkserver's imported pages and give everything back when they exit.
"""

from __future__ import annotations

import codecs
import faulthandler
import gc
import logging
import multiprocessing
import os
import pickle
import re
import signal
import sys
import traceback
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from multiprocessing import spawn
from multiprocessing.connection import wait
from typing import Any

from compressflow.errors import CalibrationError, CompressflowError
from compressflow.logs import run_logger, stage_name
from compressflow.model.cpus import ChildThreads

# The libraries, the modules whose functions children run, and what children would build
# again; verify's checks, a sibling of runtime. No Prefect: nothing a child runs needs it.
PRELOAD = ["compressflow.runtime.preload", "compressflow.verification.run"]
STAGE_LAYERS = ("compressflow.flows", "compressflow.tasks")
KILL_GRACE_SECONDS = 10
# A child that has sent its end is exiting (milliseconds, as a rule): how long it may take.
EXIT_GRACE_SECONDS = 2
TAIL_LINES = 6  # the child's last words kept for the error
_PROGRESS_BAR = re.compile(r"\d+%\|")  # tqdm redraws: noise, not last words
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


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
        # Loaded too: an exception whose __init__ takes other arguments than its args
        # (transformers' StrictDataclassFieldValidationError) pickles, then fails to load in the
        # task's process with a TypeError that hides it.
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # a library exception that cannot cross processes: keep its text
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _where(exc: BaseException) -> str:
    """`package/module.py:line (function)` of the innermost frame that raised `exc`."""
    # Not the `exit` builtin itself (<frozen _sitebuiltins>): the code that called it.
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    if not frames:
        return "an unknown place"
    frame = frames[-1]
    return f"{frame.filename.rsplit('site-packages/', 1)[-1]}:{frame.lineno} ({frame.name})"


def _how_it_ended(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r}) in {_where(exc)}"
    return f"was stopped by {type(exc).__name__} in {_where(exc)}"


def _child(target: Callable, args: tuple, environment: dict[str, str], conn, stderr_conn) -> None:
    # What the forkserver imported goes to the permanent generation. Collected here, every one of
    # its objects would be written to (the collector's own fields), copying each page that holds
    # one from the forkserver into this child: over 100 MB of libraries' objects, counted twice.
    gc.freeze()
    # The forkserver's environment is the one it started with; the task's may have changed since.
    os.environ.clear()
    os.environ.update(environment)
    # fd 2 goes to the task, which copies it on and keeps its tail; faulthandler writes a native
    # crash's Python stack there before the process dies of its signal.
    os.dup2(stderr_conn.fileno(), 2)
    stderr_conn.close()
    faulthandler.enable()
    # Threads sized to this worker's CPUs and the children computing beside this one, re-counted
    # at each event (compressflow.model.cpus).
    threads = ChildThreads()
    try:
        serve(conn, target, args, threads.refresh)
    finally:
        threads.close()


def serve(conn, target: Callable, args: tuple, on_event: Callable[[], None] = lambda: None) -> None:
    """Run `target` in this process, sending its logs, events and end over `conn`.

    What a calibration process does, whoever started it (a forkserver, or torchrun for a rank).
    `on_event` runs in this process at each event `target` sends.
    """
    logger = logging.getLogger("compressflow")
    logger.addHandler(_PipeHandler(conn))
    logger.setLevel(logging.INFO)
    logger.propagate = False

    def events(kind: str, payload: Any = None) -> None:
        conn.send((kind, payload))
        on_event()

    try:
        result = target(*args, events=events)
        conn.send(("result", result))
    except Exception as exc:  # goes back to the task, which re-raises it
        conn.send(("error", (_picklable(exc), _picklable(exc.__cause__), traceback.format_exc())))
    except BaseException as exc:
        # A library's sys.exit (auto-round's) or an interrupt: re-raised in the task it would end
        # the flow run itself (Crashed, no field, no fix). It is a failed calibration instead.
        sys.stderr.flush()
        conn.send(("ended", (_how_it_ended(exc), traceback.format_exc())))
    finally:
        conn.close()


class _Tail:
    """The last lines the child printed or logged: its last words if it dies."""

    def __init__(self):
        self.lines: deque[str] = deque(maxlen=TAIL_LINES)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._partial = ""
        self._frames: int | None = None  # frames kept of a faulthandler dump

    def add(self, text: str) -> None:
        *lines, self._partial = re.split(r"[\r\n]", self._partial + text)
        for line in lines:
            line = _COLOUR.sub("", line)  # auto-round colours its log lines
            if not line.strip() or _PROGRESS_BAR.search(line) or line.startswith("Extension "):
                continue
            # faulthandler lists the innermost frame first (a traceback, last): keep the crashing
            # thread's first two. Other threads' stacks are left out: how many there are depends
            # on what the process imported, and they would push the last logged line out.
            if line.startswith("Thread 0x"):
                self._frames = -1
                continue
            if line.startswith("Current thread"):
                self._frames = 0
            elif not line.startswith(" "):
                self._frames = None
            elif self._frames == -1:
                continue
            elif self._frames is not None and line.startswith("  File "):
                self._frames += 1
                if self._frames > 2:
                    continue
            self.lines.append(line.rstrip()[:300])

    def logged(self, message: str) -> None:
        """A line the child logged, kept whole whatever is half-printed on its stderr."""
        # Logs come on their own pipe, so one can land mid-line of a stderr dump; joined to that
        # half line it would be read as one of faulthandler's frames and dropped.
        for line in _COLOUR.sub("", message).splitlines():
            if line.strip():
                self.lines.append(line.rstrip()[:300])

    def copy(self, stream) -> bool:
        """Copy what the child wrote to fd 2 on to the task's stderr; False at its end."""
        try:
            data = os.read(stream.fileno(), 65536)
        except OSError:
            data = b""
        text = self._decoder.decode(data, final=not data)
        if text:
            sys.stderr.write(text)
            self.add(text)
        return bool(data)

    def drain(self, stream) -> None:
        """What is left in the pipe, without waiting (a grandchild may hold it open)."""
        while not stream.closed and wait([stream], timeout=0) and self.copy(stream):
            pass
        self.add("\n")

    def text(self) -> str:
        return " | ".join(line.strip() for line in self.lines)


def _advice(signal_name: str | None, words: str) -> tuple[str, str]:
    """(field, fix) for a calibration process that ended without a result."""
    if signal_name == "SIGKILL":
        return (
            "calibration.max_cpu_memory_gb",
            "a SIGKILL is usually the kernel's out-of-memory killer: set "
            "calibration.max_cpu_memory_gb below what the worker really has, so the memory plan "
            "reads the weights from disk (disk offload) and picks a smaller batch, or set "
            "calibration.batch_size to 1, or run on a worker with more memory",
        )
    if "batch_size" in words:  # e.g. auto-round: "try to set the `batch_size` to 1"
        return (
            "calibration.batch_size",
            "set calibration.batch_size to 1 (the library's last words ask for a batch size) and "
            "report the architecture",
        )
    if signal_name:
        return (
            "calibration",
            "a crash in native code (torch or a library extension): its last words say where; "
            "rerun with calibration.batch_size 1, or report the crash with them",
        )
    return (
        "calibration",
        "the library ended the process itself: its last words say why; change what they name "
        "and run `compressflow validate` on these parameters; the full output is in the log",
    )


def _ended(what: str, how: str, tail: _Tail, signal_name: str | None = None) -> CalibrationError:
    words = tail.text()
    field, fix = _advice(signal_name, words)
    said = f"; its last words: {words.rstrip('.')}" if words else "; it printed nothing before"
    return CalibrationError(field, f"the {what} process {how}{said}", fix)


def _died(what: str, exitcode: int | None, tail: _Tail) -> CalibrationError:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return _ended(what, f"was killed by {name} (exit code {exitcode})", tail, name)
    return _ended(what, f"exited with code {exitcode} without a result", tail)


def _refuse_stage_function(target: Callable) -> None:
    """A child unpickles `target` by importing its module: a stage's would bring Prefect."""
    if target.__module__.startswith(STAGE_LAYERS):
        raise TypeError(
            f"{target.__module__}.{target.__qualname__} cannot run in a child: a stage's module "
            "imports Prefect, which the forkserver leaves out (70 MB in every child); define what "
            "a child runs in compressflow's bottom layer"
        )


def _context():
    # Only the first call's list counts: the forkserver then runs for the life of this process.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def warm_up() -> None:
    """Start the forkserver now, so its imports overlap the stages that run before calibration.

    Its ~6 s of imports would otherwise start when the first child does.
    """
    from multiprocessing import forkserver

    _context()
    with _starting_children():
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


@contextmanager
def _fork_safe_cuda_check():
    """A forkserver started in the block asks torch whether there is a GPU through NVML.

    llm-compressor asks `torch.accelerator.is_available()` when it is imported (its `modeling`
    package), which the forkserver does once for every child. Asked the usual way on a GPU host,
    that initializes the CUDA driver there, and every child forked afterwards fails its first CUDA
    call ("Cannot re-initialize CUDA in forked subprocess", seen on an H100 in the memory plan).
    torch answers through NVML, initializing nothing, when PYTORCH_NVML_BASED_CUDA_CHECK=1.
    Children get the task's own environment back (`_child`), and use CUDA as usual.
    """
    key = "PYTORCH_NVML_BASED_CUDA_CHECK"
    before = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


@contextmanager
def _starting_children():
    """Around whatever may start the forkserver or a child (`warm_up`, `run_isolated`)."""
    with _main_script_not_rerun(), _fork_safe_cuda_check():
        yield


def run_isolated(
    target: Callable,
    args: tuple,
    on_event: Callable[[str, Any], None],
    what: str,
    environment: dict[str, str] | None = None,
) -> Any:
    """`target(*args, events=...)` in a child process; its result, or its exception re-raised.

    `target` and `args` must pickle (module-level function, pydantic results). `environment` is
    set over this process's in the child (the GPUs it may use). Whatever ends the wait (the
    result, an error, a timeout or cancellation raised here) the child is gone after.
    """
    _refuse_stage_function(target)
    context = _context()
    receiver, sender = context.Pipe(duplex=False)
    stderr, stderr_sender = context.Pipe(duplex=False)
    child_environment = {**os.environ, **(environment or {})}
    process = context.Process(
        target=_child, args=(target, args, child_environment, sender, stderr_sender), name=what
    )
    with _starting_children():
        process.start()  # starts the forkserver too, when warm_up did not
    sender.close()
    stderr_sender.close()
    log = run_logger(__name__)
    tail = _Tail()
    said_its_end = False
    try:
        while True:
            # A wait with a timeout, not a blocking recv: a timeout or cancellation raised into
            # this thread must find it running Python, not waiting inside a read.
            ready = wait([receiver] if stderr.closed else [receiver, stderr], timeout=0.5)
            if stderr in ready and not tail.copy(stderr):
                stderr.close()
            if receiver not in ready:
                if process.exitcode is not None and not receiver.poll():
                    # Gone without closing the pipe (a grandchild holds it): as below.
                    tail.drain(stderr)
                    raise _died(what, process.exitcode, tail)
                continue
            try:
                kind, payload = receiver.recv()
            except EOFError:  # the child died without a word: a signal, or os._exit
                process.join(KILL_GRACE_SECONDS)
                tail.drain(stderr)
                raise _died(what, process.exitcode, tail) from None
            if kind in ("result", "error", "ended"):
                said_its_end = True
                tail.drain(stderr)  # what it printed last, before its last message
            if kind == "result":
                return payload
            if kind == "error":
                exc, cause, text = payload
                if not isinstance(exc, CompressflowError):  # a refusal says all it needs to
                    log.error("%s failed in its process:\n%s", what, text)
                raise exc from cause
            if kind == "ended":
                how, text = payload
                log.error("%s ended in its process:\n%s", what, text)
                raise _ended(what, how, tail)
            if kind == "log":
                log.log(*payload)
                tail.logged(payload[1])
            else:
                on_event(kind, payload)
    finally:
        if said_its_end:
            # Its exit runs multiprocessing's finalizers, which unlink the named semaphores it
            # made (tqdm's lock, in every child that shows a progress bar). Stopped at once, it
            # left each in /dev/shm and a "leaked semaphore objects" warning at the task's exit.
            process.join(EXIT_GRACE_SECONDS)
        receiver.close()
        stderr.close()
        if process.is_alive():
            process.terminate()
            process.join(KILL_GRACE_SECONDS)
        if process.is_alive():
            process.kill()
        process.join()


def _call(function: Callable, args: tuple, events: Callable) -> Any:
    return function(*args)


def in_child(function: Callable, *args: Any) -> Any:
    """`function(*args)` in a child forked from the forkserver: its result or its exception.

    For the stages' work that needs torch, transformers or llm-compressor: they are imported in
    the forkserver once and never in the task's process. `function` and `args` must pickle.
    """
    # A death names the stage and the function: "the plan memory (plan_for) process was killed
    # by SIGKILL". Outside a task run, the function's module stands in (model/memory.py:
    # "memory"): functions live below the stages, so their modules are not the stages' names.
    stage = stage_name() or function.__module__.rsplit(".", 1)[-1].replace("_", " ")
    what = f"{stage} ({function.__name__})"
    _refuse_stage_function(function)
    return run_isolated(_call, (function, args), lambda kind, payload: None, what)
