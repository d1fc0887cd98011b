"""One writer per output folder: an exclusive lock held from the reuse check through publishing.

Two runs aimed at the same `save_directory` would otherwise both calibrate (hours of GPU) and race
to publish. The lock is `flock` on a hidden file beside the output (`.<name>.lock`): the kernel
drops it when its process dies, SIGKILL included, so a killed run never leaves a stale lock. The
holder writes who it is into the file, so a run that waits can say what it waits for. Waiting is
bounded by `COMPRESSFLOW_LOCK_TIMEOUT_SECONDS` (default 6 h), then fails with a PublishError.

`flock` works between processes on one host and on NFSv4 mounts (Linux maps it to byte-range
locks there). A forked child shares its parent's lock: one that outlives the run holds it until
it exits too.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from compressflow.errors import PublishError
from compressflow.logs import run_logger
from compressflow.settings import settings

POLL_SECONDS = 2.0
REMIND_SECONDS = 600  # how often a long wait logs again


def lock_path(target: Path) -> Path:
    return target.parent / f".{target.name}.lock"


def lock_timeout() -> float:
    return settings().lock_timeout_seconds


def read_holder(target: Path) -> dict | None:
    """Who holds (or last held) the lock of `target`; None when unknown."""
    try:
        return json.loads(lock_path(target).read_text())
    except (FileNotFoundError, json.JSONDecodeError):  # none, or the holder is mid-write
        return None


def describe(holder: dict | None) -> str:
    if not holder:
        return "another run"
    return (
        f"pid {holder['pid']} on {holder['host']} (flow run {holder['flow_run_name']} "
        f"{holder['flow_run_id']}, since {holder['started_at']})"
    )


def _holder_info() -> dict:
    from prefect.runtime import flow_run

    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "flow_run_id": flow_run.id,
        "flow_run_name": flow_run.name,
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _is_current(fd: int, path: Path) -> bool:
    """True when `fd` is still the file at `path` (the last holder did not unlink it meanwhile)."""
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _acquire(target: Path, timeout: float, logger, field: str, error: type) -> int:
    path = lock_path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    reminded, last_holder = 0.0, None
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
        else:
            if _is_current(fd, path):
                return fd
            os.close(fd)  # locked a file its holder had just unlinked: lock the new one
            continue
        waited = time.monotonic() - started
        holder = read_holder(target)
        if waited >= timeout:
            raise error(
                field,
                f"{target} is still being written by {describe(holder)} after waiting "
                f"{waited:.0f} s",
                f"let that run finish or cancel it, choose another {field.split('.')[-1]}, or "
                "raise COMPRESSFLOW_LOCK_TIMEOUT_SECONDS",
            )
        if holder != last_holder or waited - reminded >= REMIND_SECONDS:
            logger.info(
                "Waiting for %s: %s is writing it (waited %.0f s of %.0f s)",
                target,
                describe(holder),
                waited,
                timeout,
            )
            reminded, last_holder = waited, holder
        time.sleep(min(POLL_SECONDS, max(timeout - waited, 0.01)))


@contextmanager
def output_lock(
    target: Path,
    logger=None,
    timeout: float | None = None,
    field: str = "output.save_directory",
    error: type = PublishError,
) -> Iterator[None]:
    """Hold the exclusive lock of `target`, waiting (bounded) while another run holds it; a wait
    past the bound is refused as `error` naming `field` (what chose `target`)."""
    logger = logger or run_logger(__name__)
    fd = _acquire(target, lock_timeout() if timeout is None else timeout, logger, field, error)
    path = lock_path(target)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_holder_info()).encode(), 0)
        yield
    finally:
        # Unlink while still locked: a waiter that opened this file sees it is no longer current
        # and retries on a new one, so it never holds a lock nobody else can see.
        if _is_current(fd, path):
            path.unlink()
        os.close(fd)
