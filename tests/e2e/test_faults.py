"""Faults: two writers of one output, a full disk, a hub that answers 503.

The lock cases run holders in processes of their own (a SIGKILL or a second writer needs one).
Each asserts the promise of the output folder: it exists only complete, with its manifest, and a
failed or killed run leaves no staging folder and no lock. The whole-flow drills (a run killed
mid-calibration, runs racing for one output, a full disk while publishing) are
tests/matrix/test_fault_drills.py.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from safetensors import SafetensorError
from support.processes import Output, leftovers, start

from compressflow.errors import HubUnavailableError, PublishError
from compressflow.evaluation.quality import read_reference, save_reference
from compressflow.store.disk_space import (
    check_free_space,
    disk_full_errno,
    disk_full_is_clear,
)
from compressflow.store.locks import lock_path, output_lock, read_holder
from compressflow.store.staging import reference_path
from compressflow.tasks.fetch_model import fetch

pytestmark = pytest.mark.usefixtures("prefect_harness")

# Holds the lock of argv[1] until stdin closes (or until it is killed).
HOLDER_SCRIPT = r"""
import sys
from pathlib import Path
from compressflow.store.locks import output_lock

with output_lock(Path(sys.argv[1])):
    print("LOCKED", flush=True)
    sys.stdin.read()
"""

# Adds 1 to the counter in argv[1] (a read-modify-write) argv[2] times, each under the lock,
# polling every millisecond so that waiters often open the file just as its holder unlinks it.
COUNTER_SCRIPT = r"""
import sys, time
from pathlib import Path
import compressflow.store.locks
from compressflow.store.locks import output_lock

compressflow.store.locks.POLL_SECONDS = 0.001

counter = Path(sys.argv[1])
for _ in range(int(sys.argv[2])):
    with output_lock(counter):
        value = int(counter.read_text())
        time.sleep(0.001)
        counter.write_text(str(value + 1))
"""


# --- Two writers of one output ----------------------------------------------------------------


def test_lock_waits_for_its_holder_then_times_out_naming_it(tmp_path):
    target = tmp_path / "model"
    holder = start(HOLDER_SCRIPT, str(target))
    Output(holder).wait_for("LOCKED")

    started = time.monotonic()
    timeout = pytest.raises(PublishError, match=rf"pid {holder.pid} on .*COMPRESSFLOW_LOCK_TIMEOUT")
    with timeout, output_lock(target, timeout=1.5):
        pass
    assert 1.5 <= time.monotonic() - started < 5

    holder.stdin.close()  # the holder releases: the next run gets the lock and cleans up after
    assert holder.wait(30) == 0
    with output_lock(target, timeout=10):
        assert read_holder(target)["pid"] == os.getpid()
    assert leftovers(target) == []


def test_lock_of_a_killed_holder_is_free_at_once(tmp_path):
    target = tmp_path / "model"
    holder = start(HOLDER_SCRIPT, str(target))
    Output(holder).wait_for("LOCKED")
    os.killpg(holder.pid, signal.SIGKILL)
    holder.wait(30)
    assert lock_path(target).exists()  # the file stays, the kernel dropped the lock
    with output_lock(target, timeout=0):
        pass
    assert leftovers(target) == []


def test_lock_excludes_across_processes_while_holders_unlink_it(tmp_path):
    # Every release unlinks the file while others wait on it: without the inode re-check two
    # processes would hold locks on different files at once and lose increments.
    counter = tmp_path / "counter"
    counter.write_text("0")
    workers = [start(COUNTER_SCRIPT, str(counter), "100") for _ in range(4)]
    for worker in workers:
        assert worker.wait(120) == 0, worker.stdout.read()
    assert counter.read_text() == "400"
    assert leftovers(counter) == []


# --- A full disk -----------------------------------------------------------------------------


def fetch_model_args(path: Path):
    from compressflow.params import ModelArgs

    return fetch(ModelArgs(model_id=str(path)))


def test_too_little_space_is_refused_before_calibration(tiny_model, tmp_path, caplog):
    model = fetch_model_args(tiny_model)
    huge = model.model_copy(update={"parameters": 10**15})  # 500 TB of 4-bit weights
    with pytest.raises(
        PublishError,
        match=rf"{re.escape(str(tmp_path))} has .* free, but .* needs at least 500\.0 TB",
    ):
        check_free_space(tmp_path, huge, "W4A16", True)

    # Only a floor refuses: an original larger than the free space is a warning, as is a scheme
    # whose size cannot be told from its name (the run may still fit).
    big = model.model_copy(update={"size_bytes": 10**18})
    with caplog.at_level(logging.WARNING):
        check_free_space(tmp_path, big, "W4A16", True)
        check_free_space(tmp_path, huge, "custom-sparsity", True)
    assert "may need up to 1000000.0 TB" in caplog.text


def test_disk_full_errors_are_recognised_however_they_are_raised(tmp_path):
    assert disk_full_errno(OSError(errno.ENOSPC, "No space left on device")) == errno.ENOSPC
    assert disk_full_errno(OSError(errno.EDQUOT, "Disk quota exceeded")) == errno.EDQUOT
    assert (
        disk_full_errno(SafetensorError("I/O error: File too large (os error 27)")) == errno.EFBIG
    )
    assert disk_full_errno(OSError(errno.EACCES, "Permission denied")) is None
    # Anything else passes through unchanged.
    with pytest.raises(PermissionError), disk_full_is_clear(tmp_path / "staging"):
        raise PermissionError(errno.EACCES, "Permission denied")


REFERENCE_SCRIPT = """
import resource, signal, sys, torch
from pathlib import Path
from compressflow.evaluation.quality import save_reference
from compressflow.store.disk_space import disk_full_is_clear
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
staging = Path(sys.argv[1])
with disk_full_is_clear(staging):  # as calibrate's capture_reference saves
    save_reference(Path(sys.argv[2]), [[1, 2]], [torch.zeros(2, 50_000)])
"""


def test_a_full_disk_while_saving_the_reference_logits_says_so(tmp_path):
    staging = tmp_path / ".out.staging-1-0123abcd"
    reference = reference_path(staging)
    run = subprocess.run(
        [sys.executable, "-c", REFERENCE_SCRIPT, str(staging), str(reference)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    assert re.search(
        r"PublishError: output.save_directory: disk full while saving to \S+ \(EFBIG", run.stderr
    ), run.stderr[-3000:]


def test_the_reference_logits_read_back_as_saved(tmp_path):
    import torch

    logits = [torch.randn(3, 7), torch.randn(5, 7)]
    save_reference(tmp_path / "r.safetensors", [[1, 2, 3], [4, 5, 6, 7, 8]], logits)
    back = read_reference(tmp_path / "r.safetensors")
    assert back["input_ids"] == [[1, 2, 3], [4, 5, 6, 7, 8]]
    assert all(torch.equal(a, b) for a, b in zip(back["logits"], logits, strict=True))


# --- A hub that answers 503 ------------------------------------------------------------------


@pytest.fixture()
def unavailable_hub(monkeypatch):
    """A local 'hub' that answers 503 to everything; returns the paths it was asked for."""
    from huggingface_hub import constants

    requests: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            requests.append(self.path)
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_HEAD = do_GET

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # huggingface_hub reads HF_HUB_OFFLINE and HF_ENDPOINT once, at import.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    yield requests
    server.shutdown()


def test_hub_outage_is_retried_then_given_up_with_a_clear_message(unavailable_hub):
    from prefect import flow

    from compressflow.params import ModelArgs
    from compressflow.tasks.fetch_model import fetch_model

    @flow
    def fetch_only():
        return fetch_model.with_options(retry_delay_seconds=0)(ModelArgs(model_id="acme/down"))

    with pytest.raises(HubUnavailableError) as error:
        fetch_only()
    message = str(error.value)
    assert "answered 503 Service Unavailable for acme/down@main on try 4 of 4; giving up" in message
    assert "Fix: retry later" in message
    model_requests = [path for path in unavailable_hub if path.startswith("/api/models/acme/down")]
    assert len(model_requests) == 4, unavailable_hub
