"""The manifest a run publishes keeps the shape published folders already carry: a later run's reuse
check and evaluate-model read those folders back, so its keys, and the names under which it
records a calibration's figures (flat, not nested), change only on purpose."""

from __future__ import annotations

import json
from pathlib import Path

from compressflow.inputs import Inputs, RunArgs
from compressflow.params import ModelArgs, OutputArgs, RecipeArgs
from compressflow.results import (
    BuiltDataset,
    Calibration,
    FetchedModel,
    LayerTime,
    MemoryPlan,
    ModuleMetric,
    RenderedRecipe,
    StageRecord,
    Verification,
    VerificationCheck,
)
from compressflow.store.manifest import Manifest, read_manifest, write_manifest

KEYS = [
    "created_at",
    "result",
    "inputs",
    "model",
    "dataset",
    "recipe",
    "libraries",
    "stages",
    "calibration_seconds",
    "resumed_from",
    "reference_seconds",
    "peak_rss_mb",
    "peak_gpu_mb",
    "modules",
    "layers",
    "tags",
    "verification",
    "memory_plan",
    "target",
    "evaluation",
    "files",
    "file_sha256",
]
RESULT_KEYS = [
    "run_key",
    "model_identity",
    "scheme",
    "size_bytes",
    "original_size_bytes",
    "compression_ratio",
]

CALIBRATION = Calibration(
    staging_path="/work/.out.staging-1-0123abcd",
    seconds=12.345678,
    peak_rss_mb=1500.5,
    peak_gpu_mb=2500.25,
    checkpoint_bytes=1_000,
    modules=[ModuleMetric(name="model.layers.0.mlp.down_proj", error=0.5, seconds=0.25)],
    layers=[LayerTime(calibration_pass=1, layer=0, seconds=0.75)],
    reference_seconds=3.5,
    reference_path="/work/.out.staging-1-0123abcd.reference.safetensors",
    resumed_from="pass 1, layer 3 of 9",
)


def inputs(tmp_path: Path) -> Inputs:
    return Inputs(
        args=RunArgs(
            model=ModelArgs(model_id="m"),
            recipe=RecipeArgs(preset="W4A16"),
            output=OutputArgs(tags=["nightly"]),
        ),
        recipe=RenderedRecipe(
            yaml="quant_stage: {}\n",
            sha256="r",
            source="preset:W4A16",
            modifiers=["GPTQModifier"],
            scheme="W4A16",
            pipeline="sequential",
            needs_data=True,
        ),
        model=FetchedModel(
            path=str(tmp_path / "m"),
            source="local",
            model_id="m",
            identity="sha256:m",
            size_bytes=4_321,
        ),
        dataset=BuiltDataset(
            path=str(tmp_path / "data"),
            fingerprint="f",
            source="shortcut:python_docs",
            num_samples=8,
            token_stats={"min": 1, "mean": 2, "max": 3, "total": 16},
        ),
        target=tmp_path / "out",
        key="k" * 64,
    )


PLAN = MemoryPlan(
    path="classic",
    placement="cpu",
    device="cpu",
    weight_bytes=1,
    largest_layer_bytes=1,
    state_bytes=1,
    activation_bytes=1,
    batch_bytes=1,
    cpu_needed_bytes=1,
    cpu_available_bytes=2,
    batch_size=1,
    sequential_prefetch=False,
    sequential_offload_device="cpu",
    moe_calibrate_all_experts=False,
    weights_in_memory_bytes=1,
)
VERIFIED = Verification(
    passed=True, checks=[VerificationCheck(name="logits", passed=True, detail="ok")]
)
STAGES = [StageRecord(name="calibrate", seconds=12.5, cached=False)]


def test_a_manifest_keeps_the_keys_published_folders_carry(tmp_path):
    made = Manifest.of_run(inputs(tmp_path), CALIBRATION, PLAN, VERIFIED, STAGES, None)
    written = json.loads(made.model_dump_json(indent=2))
    assert list(written) == KEYS
    assert list(written["result"]) == RESULT_KEYS


def test_a_manifest_records_a_calibration_flat_and_leaves_its_run_paths_out(tmp_path):
    made = Manifest.of_run(inputs(tmp_path), CALIBRATION, PLAN, VERIFIED, STAGES, None)
    written = json.loads(made.model_dump_json(indent=2))
    assert {key: written[key] for key in KEYS[8:15]} == {
        "calibration_seconds": 12.346,
        "resumed_from": "pass 1, layer 3 of 9",
        "reference_seconds": 3.5,
        "peak_rss_mb": 1500.5,
        "peak_gpu_mb": 2500.25,
        "modules": [{"name": "model.layers.0.mlp.down_proj", "error": 0.5, "seconds": 0.25}],
        "layers": [{"calibration_pass": 1, "layer": 0, "seconds": 0.75}],
    }
    assert written["result"] == {
        "run_key": "k" * 64,
        "model_identity": "sha256:m",
        "scheme": "W4A16",
        "size_bytes": 1_000,
        "original_size_bytes": 4_321,
        "compression_ratio": 4.321,
    }
    assert written["tags"] == ["nightly"]
    assert "path" not in written["model"] and "path" not in written["dataset"]
    assert "yaml" not in written["recipe"]
    # What the run keeps beside its staging folder is its own, never published.
    assert "staging" not in json.dumps(written)
    assert written["files"] is None and written["file_sha256"] is None  # set once staged


def test_a_manifest_reads_back_as_it_was_written(tmp_path):
    made = Manifest.of_run(inputs(tmp_path), CALIBRATION, PLAN, VERIFIED, STAGES, None)
    made.files = ["manifest.json"]
    made.file_sha256 = {}
    (tmp_path / "out").mkdir()
    write_manifest(tmp_path / "out", made)
    assert read_manifest(tmp_path / "out") == made
