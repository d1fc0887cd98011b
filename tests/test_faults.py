"""Faults: a killed run, two writers of one output, a full disk, a hub that answers 503.

The flow-level cases run the compress-model flow in subprocesses (real Prefect against the
session's test server, real oneshot), because a SIGKILL, a second writer or a file-size limit
need a process of their own. Each asserts the promise of the output folder: it exists only
complete, with its manifest, and a failed or killed run leaves no staging folder and no lock.
"""

from __future__ import annotations

import errno
import json
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

from compressflow.errors import HubUnavailableError, PublishError
from compressflow.reporting.quality import read_reference, save_reference
from compressflow.store.disk_space import (
    check_free_space,
    disk_full_errno,
    disk_full_is_clear,
)
from compressflow.store.locks import lock_path, output_lock, read_holder
from compressflow.store.manifest import reference_path
from compressflow.tasks.fetch_model import fetch

pytestmark = pytest.mark.usefixtures("prefect_harness")

REPO = Path(__file__).resolve().parents[1]

# Runs the flow with the parameters in argv[1]; prints the result as one JSON line. With "go",
# it imports everything first and waits for a line on stdin, so a test can time its start.
FLOW_SCRIPT = r"""
import json, resource, signal, sys
import llmcompressor, torch, transformers
from compressflow.flows.compress import compress
from compressflow.params import DatasetArgs, ModelArgs, OutputArgs, RecipeArgs

params = json.loads(sys.argv[1])
if params.pop("wait_for_go", False):
    print("READY", flush=True)
    sys.stdin.readline()
if limit := params.pop("file_size_limit", None):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so an oversized write fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
published = compress(
    model=ModelArgs(**params["model"]),
    dataset=DatasetArgs(**params["dataset"]),
    recipe=RecipeArgs(**params["recipe"]),
    output=OutputArgs(**params["output"]),
)
print("PUBLISHED " + published.model_dump_json(), flush=True)
"""

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


def flow_env(home: Path) -> dict[str, str]:
    """The session's environment, pointed at the test server and at caches under `home`."""
    from prefect.settings import PREFECT_API_URL

    return {
        **os.environ,
        "PREFECT_API_URL": PREFECT_API_URL.value(),  # no temporary server: saves ~20 s a process
        "PREFECT_HOME": str(home / "prefect"),  # result storage, so cache records are shared
        "COMPRESSFLOW_CACHE_DIR": str(home / "cache"),
        "PYTHONPATH": str(REPO),
    }


def flow_params(model: Path, target: Path, recipe: str = "W4A16", samples: int = 16, **extra):
    return {
        "model": {"model_id": str(model)},
        "dataset": {"dataset_name": "python_docs", "text_samples": samples, "max_seq_len": 128},
        "recipe": {"recipe": recipe},
        "output": {"save_directory": str(target)},
        **extra,
    }


def start(script: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        env=env or {**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, so a kill takes its children too
    )


class Output:
    """Collects a process's output lines in a thread; `wait_for` blocks until a line matches."""

    def __init__(self, process: subprocess.Popen):
        self.process, self.lines, self.changed = process, [], threading.Condition()
        self.ended = False
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
        with self.changed:
            self.ended = True
            self.changed.notify_all()

    def wait_for(self, pattern: str, timeout: float = 180) -> str:
        regex = re.compile(pattern)
        with self.changed:
            self.changed.wait_for(lambda: self.ended or any(map(regex.search, self.lines)), timeout)
            match = next(filter(regex.search, self.lines), None)
        assert match, f"no line matching {pattern!r}:\n{self.text()[-5000:]}"
        return match

    def finish(self, timeout: float = 180) -> str:
        self.process.wait(timeout)
        self.reader.join(timeout)
        return self.text()

    def text(self) -> str:
        return "".join(self.lines)


def published_from(text: str) -> dict:
    lines = [line for line in text.splitlines() if line.startswith("PUBLISHED ")]
    assert lines, f"the run did not publish:\n{text[-5000:]}"
    return json.loads(lines[-1].removeprefix("PUBLISHED "))


def leftovers(target: Path) -> list[str]:
    """Staging folders and lock files of `target` still on disk."""
    return sorted(p.name for p in target.parent.glob(f".{target.name}.*"))


class OutputWatcher:
    """Polls the output path during a test and records any moment it existed without a manifest."""

    def __init__(self, target: Path):
        self.target, self.partial, self.running = target, [], True
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while self.running:
            if self.target.exists() and not (self.target / "manifest.json").exists():
                self.partial.append(sorted(p.name for p in self.target.iterdir()))
            time.sleep(0.005)

    def stop(self) -> list:
        self.running = False
        self.thread.join()
        return self.partial


def reloads(path: str) -> bool:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path)
    inputs = AutoTokenizer.from_pretrained(path)(["Return the sum."], return_tensors="pt")
    with torch.no_grad():
        return bool(torch.isfinite(model(**inputs).logits).all())


# --- A run killed while it calibrates ------------------------------------------------------------


# Two flow processes (~47 s here): with `make matrix`. test_resume's matrix kills the calibration
# child too; `make test` keeps the lock and leftover checks below in seconds.
@pytest.mark.matrix
def test_run_killed_during_calibration_leaves_nothing_and_the_rerun_completes_from_cache(
    tiny_model, tmp_path
):
    target = tmp_path / "out" / "tiny-w4a16"
    env = flow_env(tmp_path)
    params = json.dumps(flow_params(tiny_model, target, samples=64))
    watcher = OutputWatcher(target)

    first = start(FLOW_SCRIPT, params, env=env)
    output = Output(first)
    output.wait_for(r"Quantizing \d+ module")  # GPTQ is working on the first layer
    os.killpg(first.pid, signal.SIGKILL)
    assert first.wait(30) == -signal.SIGKILL
    assert not target.exists()
    assert read_holder(target)["pid"] == first.pid  # its lock file is there, but not held

    rerun = start(FLOW_SCRIPT, params, env=env)
    text = Output(rerun).finish()
    assert rerun.returncode == 0, text[-5000:]
    published = published_from(text)
    partial = watcher.stop()

    assert "Waiting for" not in text, "the killed run's lock was still held"
    stages = {stage["name"]: stage["cached"] for stage in published["stages"]}
    assert stages["fetch model"] and stages["build dataset"], stages
    assert stages["calibrate"] is False and not published["reused"]
    assert partial == [], f"the output path was visible without its manifest: {partial}"
    assert leftovers(target) == []
    assert (
        json.loads((target / "manifest.json").read_text())["result"]["run_key"]
        == published["run_key"]
    )
    assert reloads(published["path"])


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


@pytest.mark.matrix  # three flow processes at once (~60 s on 2 cores): with `make matrix`
def test_concurrent_runs_of_one_output_wait_then_reuse_or_are_refused(tiny_model, tmp_path):
    target = tmp_path / "out" / "shared"
    env = flow_env(tmp_path)
    watcher = OutputWatcher(target)
    first = start(FLOW_SCRIPT, json.dumps(flow_params(tiny_model, target, samples=64)), env=env)
    same = start(
        FLOW_SCRIPT,
        json.dumps(flow_params(tiny_model, target, samples=64, wait_for_go=True)),
        env=env,
    )
    other = start(
        FLOW_SCRIPT,
        json.dumps(flow_params(tiny_model, target, recipe="W8A8", samples=64, wait_for_go=True)),
        env=env,
    )
    outputs = [Output(process) for process in (first, same, other)]
    for output in outputs[1:]:
        output.wait_for("READY")
    deadline = time.monotonic() + 180
    while (read_holder(target) or {}).get("pid") != first.pid:  # the first run holds the output
        assert time.monotonic() < deadline and first.poll() is None, outputs[0].text()[-5000:]
        time.sleep(0.05)
    for process in (same, other):
        process.stdin.write("go\n")
        process.stdin.flush()

    texts = [output.finish() for output in outputs]
    assert first.returncode == 0, texts[0][-5000:]
    assert watcher.stop() == []
    original = published_from(texts[0])
    assert not original["reused"]

    waiting = rf"Waiting for {re.escape(str(target))}: pid {first.pid} on "
    assert re.search(waiting, texts[1]), texts[1][-5000:]
    reused = published_from(texts[1])
    assert reused["reused"] and reused["run_key"] == original["run_key"]

    assert other.returncode != 0 and re.search(waiting, texts[2]), texts[2][-5000:]
    assert "already holds another compressflow output" in texts[2]
    assert "scheme W4A16" in texts[2]
    assert json.loads((target / "manifest.json").read_text())["result"]["scheme"] == "W4A16"
    assert leftovers(target) == []


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
from compressflow.reporting.quality import save_reference
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


# A whole flow process under a file-size limit (~24 s on 2 cores): with `make matrix`. make test
# keeps the fast disk-full case (the reference logits' save, above).
@pytest.mark.matrix
def test_disk_full_while_saving_publishes_nothing(tiny_model, tmp_path):
    # RLIMIT_FSIZE makes writes past 2 MB fail with EFBIG, as a full disk fails with ENOSPC; the
    # compressed checkpoint is about 5 MB, the dataset, results and logs far smaller.
    target = tmp_path / "out" / "full"
    params = flow_params(tiny_model, target, file_size_limit=2_000_000)
    run = start(FLOW_SCRIPT, json.dumps(params), env=flow_env(tmp_path))
    text = Output(run).finish()
    assert run.returncode != 0
    assert re.search(r"disk full while saving to \S+\.full\.staging-\S+ \(EFBIG", text), text[
        -5000:
    ]
    assert "nothing was published" in text
    assert not target.exists()
    assert leftovers(target) == []


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
