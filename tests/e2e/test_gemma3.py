"""A multimodal Gemma 3 whose SigLIP tower has its attention-pool head, through compress-model
(issue 57, item 6): W4A16 calibrated it, then verify refused the reload ("'NonDynamicallyQuantizable
Linear' object has no attribute 'weight'"): the head's nn.MultiheadAttention out_proj, left in 16
bits with the vision tower, was saved off the checkpoint's ignore list and quantized on reload.
The gemma3 family rule (registries/architectures.py) calibrates it as plain nn.Linear, so it is
listed; the architecture matrix runs the other presets and image calibration on the same model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open
from support.models import RANDOM_WEIGHTS, build_gemma3_pooling_head
from support.reload_check import assert_published_model_matches_base

from compressflow.flows.compress import compress
from compressflow.params import DatasetArgs, ModelArgs, OutputArgs, RecipeArgs, VerifyArgs
from compressflow.store.manifest import read_manifest

pytestmark = pytest.mark.usefixtures("prefect_harness")

GEMMA3 = "Gemma3ForConditionalGeneration"
OUT_PROJ = "vision_tower.head.attention.out_proj"


def test_w4a16_publishes_gemma3_with_its_vision_tower_and_head_in_16_bits(zoo_root, tmp_path):
    source = build_gemma3_pooling_head(zoo_root)
    published = compress(
        model=ModelArgs(model_id=str(source), model_class=GEMMA3),
        dataset=DatasetArgs(text_samples=16, max_seq_len=128),
        recipe=RecipeArgs(recipe="W4A16"),
        output=OutputArgs(save_directory=str(tmp_path / "out")),
        verify=VerifyArgs(vllm="off", **RANDOM_WEIGHTS),
    )
    path = Path(published.path)
    manifest = read_manifest(path)
    assert manifest.verification.passed, manifest.verification
    assert any("vision_tower unquantized" in note for note in manifest.recipe["notes"])
    ignore = json.loads((path / "config.json").read_text())["quantization_config"]["ignore"]
    assert any(name.endswith(OUT_PROJ) for name in ignore), ignore
    tensors = {}
    for shard in path.glob("*.safetensors"):
        with safe_open(shard, "pt") as handle:
            tensors.update({name: handle.get_slice(name).get_dtype() for name in handle.keys()})
    # The whole tower kept its 16-bit (here 32-bit) weights; the language model is packed.
    # Saved under transformers 4's names (`vision_tower.`, `language_model.`), as the source's.
    vision = {name: dtype for name, dtype in tensors.items() if "vision_tower." in name}
    assert vision[f"{OUT_PROJ}.weight"] == "F32", sorted(vision)
    assert not any("weight_packed" in name for name in vision), sorted(vision)
    assert any("language_model." in name and "weight_packed" in name for name in tensors)
    assert_published_model_matches_base(path, source, GEMMA3)
