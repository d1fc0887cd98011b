"""A long calibration survives a crash, in the flow (issue #24).

These kill the calibration child (SIGKILL, as the OOM killer or a lost spot host would) once the
checkpoint holds two finished subgraphs, rerun the same inputs, and hold the published weights to
an uninterrupted run's, tensor for tensor: on CPU every kernel here is deterministic, so nothing
looser is accepted. The checkpoints themselves: tests/unit/test_resume.py.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.processes import Output, flow_env, published_from, start

from compressflow.calibration import resume
from compressflow.demo.zoo import build_tiny, model_class

# Checkpoints are discarded only below the cache root's calibration-resume folder: each test's
# own (conftest's `cache_in_tmp_path`).
pytestmark = pytest.mark.usefixtures("cache_in_tmp_path")

# Runs compress-model with the parameter groups in argv[1]; prints the result as one JSON line.
FLOW_SCRIPT = r"""
import json, sys
from compressflow.flows.compress import compress
from compressflow.params import (
    CalibrationArgs, DatasetArgs, ModelArgs, OutputArgs, RecipeArgs, VerifyArgs,
)

params = json.loads(sys.argv[1])
published = compress(
    model=ModelArgs(**params["model"]),
    dataset=DatasetArgs(**params["dataset"]),
    recipe=RecipeArgs(**params["recipe"]),
    output=OutputArgs(**params["output"]),
    verify=VerifyArgs(**params["verify"]),
    calibration=CalibrationArgs(**params["calibration"]),
)
print("PUBLISHED " + published.model_dump_json(), flush=True)
"""


# --- The flow, killed and rerun ---------------------------------------------------------------


def run_flow(params: dict, env: dict) -> tuple[str, dict]:
    process = start(FLOW_SCRIPT, json.dumps(params), env=env)
    text = Output(process).finish(600)
    assert process.returncode == 0, text[-5000:]
    return text, published_from(text)


def kill_after_two_subgraphs(params: dict, env: dict, cache: Path) -> None:
    """Start the flow, SIGKILL its calibration child once the checkpoint holds two finished
    subgraphs, and let the flow fail."""
    process = start(FLOW_SCRIPT, json.dumps(params), env=env)
    output = Output(process)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        manifests = list((cache / resume.ROOT).glob("*/*/manifest.json"))
        state = json.loads(manifests[0].read_text()) if manifests else {}
        if state.get("finished_subgraphs", 0) >= 2:
            os.kill(state["pid"], signal.SIGKILL)
            break
        assert process.poll() is None, output.text()[-5000:]
        time.sleep(0.01)
    text = output.finish(300)
    assert process.returncode != 0, "the run finished before its calibration was killed"
    assert "calibration" in text, text[-3000:]


def assert_kill_and_resume_change_nothing(source: Path, tmp_path: Path, **groups) -> None:
    # Tensor-for-tensor equality needs the same float sums: one thread in all three runs, not a
    # share that follows what the other test process is running.
    env = {**flow_env(tmp_path), "COMPRESSFLOW_THREADS": "1"}
    cache = Path(env["COMPRESSFLOW_CACHE_DIR"])

    def params(name: str, interval: float) -> dict:
        return {
            **groups,
            "model": {"model_id": str(source), **groups.get("model", {})},
            "output": {"save_directory": str(tmp_path / "out" / name)},
            "calibration": {"checkpoint_interval_s": interval, "batch_size": 4},
        }

    _, reference = run_flow(params("uninterrupted", -1), env)
    assert not (cache / resume.ROOT).exists() or not any((cache / resume.ROOT).iterdir())

    kill_after_two_subgraphs(params("resumed", 0), env, cache)
    text, resumed = run_flow(params("resumed", 0), env)

    assert "Resuming at layer" in text, text[-5000:]
    manifest = json.loads((Path(resumed["path"]) / "manifest.json").read_text())
    assert manifest["resumed_from"] and manifest["resumed_from"].startswith("pass 1, layer ")
    assert not list((cache / resume.ROOT).glob("*/*")), "the checkpoint outlived the publish"

    expected = tensors(Path(reference["path"]))
    got = tensors(Path(resumed["path"]))
    assert got.keys() == expected.keys()
    assert [name for name in got if not torch.equal(got[name], expected[name])] == []


def tensors(folder: Path) -> dict:
    found = {}
    for file in sorted(folder.glob("*.safetensors")):
        found.update(load_file(file))
    return found


@pytest.mark.usefixtures("prefect_harness")
def test_yardstick_killed_mid_calibration_resumes_to_the_same_weights(yardstick, tmp_path):
    assert_kill_and_resume_change_nothing(
        yardstick.model,
        tmp_path,
        dataset={
            "dataset_name": str(yardstick.calibration),
            "text_samples": 64,
            "max_seq_len": yardstick.spec.seq_len,
        },
        recipe={"recipe": "W4A16"},
        verify={},
    )


@pytest.mark.usefixtures("prefect_harness")
def test_moe_killed_mid_calibration_resumes_to_the_same_weights(test_root, tmp_path):
    from support.models import RANDOM_WEIGHTS

    assert_kill_and_resume_change_nothing(
        build_tiny("qwen3_moe", test_root / "zoo"),
        tmp_path,
        model={"model_class": model_class("qwen3_moe")},
        dataset={"text_samples": 32, "max_seq_len": 128},
        recipe={"recipe": "W4A16"},
        verify=RANDOM_WEIGHTS,
    )
