"""The structural methods' presets end to end on the tiny models: W4A16_QUIP (QuIP rotations,
then GPTQ) on the tiny Llama, and `recipe.prune_experts` (REAP) before W4A16 on the tiny
Mixtral. Each publishes a verified model that is what the method makes: the rotation's
transforms saved beside the int4 weights and declared in config.json, a quarter of each MoE
layer's experts gone and config.json saying how many are left. Their refusals before
calibration: tests/unit/test_render_recipe.py and tests/unit/test_presets.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open
from support.models import RANDOM_WEIGHTS

from compressflow.demo.zoo import build_tiny
from compressflow.flows.compress import compress
from compressflow.params import DatasetArgs, ModelArgs, OutputArgs, RecipeArgs, VerifyArgs
from compressflow.store.manifest import read_manifest

pytestmark = pytest.mark.usefixtures("prefect_harness")


def small_data() -> DatasetArgs:
    return DatasetArgs(dataset_name="python_docs", text_samples=16, max_seq_len=64)


def report_calibration(published, what: str) -> None:
    """Print the calibrate stage's seconds: docs/recipes.md quotes them (run with -s)."""
    seconds = next(s.seconds for s in published.stages if s.name == "calibrate")
    print(f"\n{what}: calibrate {seconds:.1f} s")


def saved_names(path: Path) -> set[str]:
    names: set[str] = set()
    for shard in path.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as handle:
            names |= set(handle.keys())
    return names


def test_w4a16_quip_publishes_rotated_int4_weights_and_their_transforms(tiny_model, tmp_path):
    published = compress(
        model=ModelArgs(model_id=str(tiny_model)),
        dataset=small_data(),
        recipe=RecipeArgs(preset="W4A16_QUIP"),
        output=OutputArgs(save_directory=str(tmp_path / "quip")),
        verify=VerifyArgs(**RANDOM_WEIGHTS),
    )
    report_calibration(published, "W4A16_QUIP on the tiny Llama")
    path = Path(published.path)
    assert read_manifest(path).verification.passed
    quantization = json.loads((path / "config.json").read_text())["quantization_config"]
    # The rotation vLLM applies online: declared, and its matrices saved beside the weights.
    [scheme] = quantization["transform_config"]["config_groups"].values()
    assert scheme["type"] == "hadamard" and scheme["head_dim"] == 128
    names = saved_names(path)
    assert "model.layers.0.mlp.down_proj.weight_packed" in names
    assert any(name.endswith("v_input.weight") for name in names), sorted(names)[:20]
    assert published.compression_ratio > 1.5


def test_prune_experts_publishes_a_mixtral_with_fewer_experts(zoo_root, tmp_path):
    source = build_tiny("mixtral", zoo_root)  # 4 experts a layer, the router picks 2
    published = compress(
        model=ModelArgs(model_id=str(source)),
        dataset=small_data(),
        recipe=RecipeArgs(preset="W4A16", prune_experts=0.25),
        output=OutputArgs(save_directory=str(tmp_path / "reap")),
        verify=VerifyArgs(**RANDOM_WEIGHTS),
    )
    report_calibration(published, "prune_experts 0.25 + W4A16 on the tiny Mixtral")
    path = Path(published.path)
    manifest = read_manifest(path)
    assert manifest.verification.passed
    assert "REAPPruningModifier" in (path / "recipe.yaml").read_text()
    config = json.loads((path / "config.json").read_text())
    assert config["num_local_experts"] == 3 and config["num_experts_per_tok"] == 2
    names = saved_names(path)
    for layer in (0, 1):
        experts = {
            name.split(".experts.")[1].split(".")[0]
            for name in names
            if name.startswith(f"model.layers.{layer}.") and ".experts." in name
        }
        assert len(experts) == 3, sorted(experts)
    # The router keeps a row per expert kept.
    with safe_open(str(next(path.glob("*.safetensors"))), framework="pt") as handle:
        router = [
            n for n in handle.keys() if n.startswith("model.layers.0.") and "gate.weight" in n
        ]
        assert router and handle.get_slice(router[0]).get_shape()[0] == 3
