"""Fault drills on whole flows: a killed run, runs racing for one output, a full disk while
publishing.

They run the compress-model flow in subprocesses (real Prefect against the session's test
server, real oneshot), because a SIGKILL, a second writer or a file-size limit need a process of
their own. Each asserts the promise of the output folder: it exists only complete, with its
manifest, and a failed or killed run leaves no staging folder and no lock. The fast cases (locks,
disk space, the hub) are tests/e2e/test_faults.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from support.processes import Output, flow_env, leftovers, published_from, start

from compressflow.store.locks import read_holder

pytestmark = pytest.mark.usefixtures("prefect_harness")

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


def flow_params(model: Path, target: Path, recipe: str = "W4A16", samples: int = 16, **extra):
    return {
        "model": {"model_id": str(model)},
        "dataset": {"dataset_name": "python_docs", "text_samples": samples, "max_seq_len": 128},
        "recipe": {"recipe": recipe},
        "output": {"save_directory": str(target)},
        **extra,
    }


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


# Two flow processes (~47 s here): with `make matrix`. tests/matrix/test_resume_after_kill.py kills
# the calibration child too; `make test` keeps the lock and leftover checks (tests/e2e/test_faults.py)
# in seconds.
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


# Three flow processes at once (~60 s on 2 cores): with `make matrix`.
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
    # Paused while it holds the output, so the others find it held however fast it calibrates
    # (a tiny model's calibration can end before a second flow has started).
    waiting = rf"Waiting for {re.escape(str(target))}: pid {first.pid} on "
    os.killpg(first.pid, signal.SIGSTOP)
    try:
        for process in (same, other):
            process.stdin.write("go\n")
            process.stdin.flush()
        for output in outputs[1:]:
            output.wait_for(waiting)
    finally:
        os.killpg(first.pid, signal.SIGCONT)

    texts = [output.finish() for output in outputs]
    assert first.returncode == 0, texts[0][-5000:]
    assert watcher.stop() == []
    original = published_from(texts[0])
    assert not original["reused"]

    assert re.search(waiting, texts[1]), texts[1][-5000:]
    reused = published_from(texts[1])
    assert reused["reused"] and reused["run_key"] == original["run_key"]

    assert other.returncode != 0 and re.search(waiting, texts[2]), texts[2][-5000:]
    assert "already holds another compressflow output" in texts[2]
    assert "scheme W4A16" in texts[2]
    assert json.loads((target / "manifest.json").read_text())["result"]["scheme"] == "W4A16"
    assert leftovers(target) == []


# A whole flow process under a file-size limit (~24 s on 2 cores): with `make matrix`. make test
# keeps the fast disk-full case (the reference logits' save, tests/e2e/test_faults.py).
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
