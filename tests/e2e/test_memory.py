"""The memory plan, end to end: the flow on the tiny model down each path (model-free, weights
from disk), what it published reloaded in a fresh process, the knobs in the manifest, and a
calibration stopped by its timeout. The plan's unit tests: tests/unit/test_memory_plan.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.plans import data
from support.reload_check import assert_published_model_matches_base

from compressflow.flows.compress import compress
from compressflow.model.memory import CPU_RESERVE, GIB, plan_for
from compressflow.params import CalibrationArgs, DatasetArgs, ModelArgs, OutputArgs, RecipeArgs
from compressflow.recipes.render import render
from compressflow.tasks.fetch_model import fetch


def tiny_run(tiny_model, tmp_path, recipe, calibration):
    target = tmp_path / "out"
    compress(
        model=ModelArgs(model_id=str(tiny_model)),
        dataset=DatasetArgs(text_samples=16, max_seq_len=64),
        recipe=RecipeArgs(recipe=recipe),
        output=OutputArgs(save_directory=str(target)),
        calibration=calibration,
    )
    return target, json.loads((target / "manifest.json").read_text())


def test_a_data_free_scheme_goes_shard_by_shard_and_is_verified_weight_by_weight(
    prefect_harness, tiny_model, tmp_path
):
    target, manifest = tiny_run(tiny_model, tmp_path, "FP8_DYNAMIC", CalibrationArgs())
    plan_ = manifest["memory_plan"]
    assert (plan_["path"], plan_["placement"], plan_["weights_in_memory_bytes"]) == (
        "model_free",
        "shards",
        0,
    )
    # model_free_ptq matches names, not classes: the embedding must be told to stay as it is.
    assert plan_["model_free_ignore"] == ["lm_head", "model.embed_tokens"]
    checks = {c["name"]: c for c in manifest["verification"]["checks"]}
    assert checks["weights"]["passed"] and checks["weights"]["detail"].startswith("14 weights")
    assert checks["logits"]["passed"]
    assert not list(tmp_path.glob(".*offload*")), "offload folder left behind"
    assert_published_model_matches_base(target, tiny_model, "AutoModelForCausalLM")


def test_the_classic_path_can_be_forced_for_a_data_free_scheme(
    prefect_harness, tiny_model, tmp_path
):
    _, manifest = tiny_run(tiny_model, tmp_path, "FP8_DYNAMIC", CalibrationArgs(path="classic"))
    assert manifest["memory_plan"]["path"] == "classic"
    assert "weights" not in {c["name"] for c in manifest["verification"]["checks"]}


def test_a_cap_below_the_weights_calibrates_from_disk_and_publishes_a_verified_model(
    prefect_harness, tiny_model, tmp_path
):
    model = fetch(ModelArgs(model_id=str(tiny_model)))
    recipe = render(RecipeArgs(recipe="W4A16"))
    in_memory = plan_for(model, recipe, data(16, 64), CalibrationArgs(batch_size=1), tmp_path)
    assert in_memory.placement == "cpu"
    # Between what the weights-on-disk plan needs (the weights swapped for two layers) and what
    # keeping them in memory needs.
    cap = (
        in_memory.cpu_needed_bytes
        - in_memory.weight_bytes
        + 2 * in_memory.largest_layer_bytes
        + 2**19
    )
    assert cap < in_memory.cpu_needed_bytes and cap > CPU_RESERVE
    # One thread in both runs: the bytes are compared, and an automatic share follows what the
    # other test process computes at the moment (two runs could sum in another order).
    target, manifest = tiny_run(
        tiny_model,
        tmp_path,
        "W4A16",
        CalibrationArgs(batch_size=1, threads=1, max_cpu_memory_gb=cap / GIB),
    )
    assert manifest["memory_plan"]["placement"] == "disk"
    assert manifest["verification"]["passed"]
    assert not list(tmp_path.glob(".*offload*")), "offload folder left behind"
    assert_published_model_matches_base(target, tiny_model, "AutoModelForCausalLM")
    # Reading weights from disk changes where they live, not what GPTQ computes from them.
    in_memory_target, _ = tiny_run(
        tiny_model, tmp_path / "in-memory", "W4A16", CalibrationArgs(batch_size=1, threads=1)
    )
    assert tensors(target) == tensors(in_memory_target)


def tensors(folder: Path) -> dict[str, bytes]:
    from safetensors.torch import load_file

    return {
        name: tensor.numpy().tobytes()
        for file in sorted(folder.glob("*.safetensors"))
        for name, tensor in load_file(file).items()
    }


def test_the_chosen_knobs_are_in_the_manifest(w4a16_run):
    # The shared run asks for batch_size 4 and moe_calibrate_all_experts false.
    target = Path(w4a16_run.published.path)
    manifest = json.loads((target / "manifest.json").read_text())
    plan_ = manifest["memory_plan"]
    assert plan_["batch_size"] == 4 and plan_["moe_calibrate_all_experts"] is False
    assert plan_["sequential_offload_device"] == "cpu" and plan_["sequential_prefetch"] is False
    assert manifest["inputs"]["calibration"]["batch_size"] == 4
    assert (target / "recipe.yaml").exists()
    card = (target / "README.md").read_text()
    assert (
        "- **Calibration memory**: classic path, weights on cpu, computed on cpu; batch 4\n" in card
    )


def hanging_collator(batch):
    """Records the calibration process's pid, then hangs as a stuck calibration would."""
    import os
    import time

    Path(os.environ["HANG_PID_FILE"]).write_text(str(os.getpid()))
    time.sleep(600)


def test_a_timeout_stops_calibration_and_its_process(
    prefect_harness, tiny_model, tmp_path, monkeypatch
):
    import os
    import time

    from compressflow.errors import StageTimedOut

    pid_file = tmp_path / "pid"
    monkeypatch.setenv("HANG_PID_FILE", str(pid_file))
    started = time.monotonic()
    with pytest.raises(StageTimedOut, match=r"^calibration\.timeout_minutes: the calibrate stage"):
        compress(
            model=ModelArgs(model_id=str(tiny_model)),
            dataset=DatasetArgs(
                text_samples=4, max_seq_len=32, data_collator="test_memory:hanging_collator"
            ),
            recipe=RecipeArgs(recipe="W4A16"),
            output=OutputArgs(save_directory=str(tmp_path / "out")),
            calibration=CalibrationArgs(timeout_minutes=0.15),
        )
    assert time.monotonic() - started < 120
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the calibration process is gone, not left running
    assert not (tmp_path / "out").exists()
