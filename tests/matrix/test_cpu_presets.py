"""Every CPU preset end to end on the tiny model (compress, verify, publish), the published
folder reloaded in a fresh process and compared with the base model, but those published,
verified and reloaded elsewhere (ELSEWHERE); and the FP8 KV cache's own calibration. The registry's fast checks: tests/unit/test_presets.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.models import RANDOM_WEIGHTS
from support.recipes import BF16_PRESETS
from support.reload_check import assert_published_model_matches_base

from compressflow.flows.compress import compress
from compressflow.params import DatasetArgs, ModelArgs, OutputArgs, RecipeArgs, VerifyArgs
from compressflow.registries.presets import KV_CACHE_FP8, PRESETS, resolve_args
from compressflow.store.manifest import read_manifest

# Published, verified and reloaded elsewhere: W4A16, W8A8 and FP8_DYNAMIC on every architecture
# of test_architectures.py, Llama's included; W4A16_AUTOROUND in test_auto_round.py (its
# compile takes a minute a run); W4A16_QUIP in tests/e2e/test_method_presets.py (make test: its
# saved transforms checked there, ~1 s of calibration). The other CPU presets here.
ELSEWHERE = {"W4A16", "W8A8", "FP8_DYNAMIC", "W4A16_AUTOROUND", "W4A16_QUIP"}
CPU_PRESETS = [name for name, preset in PRESETS.items() if preset.cpu_ok and name not in ELSEWHERE]


def small_data() -> DatasetArgs:
    return DatasetArgs(dataset_name="python_docs", text_samples=16, max_seq_len=64)


@pytest.fixture(scope="session")
def tiny_model_bf16(tiny_model, test_root) -> Path:
    """The tiny model saved in bf16, the dtype real checkpoints ship in."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = test_root / "tiny-llama-bf16"
    if not (path / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)
        model.save_pretrained(path)
        AutoTokenizer.from_pretrained(tiny_model).save_pretrained(path)
    return path


# ---------------------------------------------------------------- CPU presets end to end


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.parametrize("name", CPU_PRESETS)
def test_cpu_preset_publishes_a_verified_model_that_reloads(
    name, tiny_model, tiny_model_bf16, tmp_path
):
    source = tiny_model_bf16 if name in BF16_PRESETS else tiny_model
    published = compress(
        model=ModelArgs(model_id=str(source)),
        dataset=small_data(),
        recipe=RecipeArgs(preset=name),
        output=OutputArgs(save_directory=str(tmp_path / name)),
        verify=VerifyArgs(**RANDOM_WEIGHTS),
    )
    assert read_manifest(Path(published.path)).verification.passed
    assert published.compression_ratio > 1.5
    assert_published_model_matches_base(Path(published.path), source, "LlamaForCausalLM")


# A preset's own calibration, ~10 s: with the preset matrix.
@pytest.mark.usefixtures("prefect_harness")
def test_fp8_kv_cache_calibrates_and_saves_kv_scales(tiny_model, tmp_path):
    from safetensors import safe_open

    published = compress(
        model=ModelArgs(model_id=str(tiny_model)),
        dataset=small_data(),
        recipe=RecipeArgs(
            preset="FP8_DYNAMIC",
            recipe_args=resolve_args("FP8_DYNAMIC", {"kv_cache_scheme": "fp8"}),
        ),
        output=OutputArgs(save_directory=str(tmp_path / "kv")),
    )
    path = Path(published.path)
    assert read_manifest(path).verification.passed
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert {k: config["kv_cache_scheme"][k] for k in KV_CACHE_FP8} == KV_CACHE_FP8
    with safe_open(str(next(path.glob("*.safetensors"))), framework="pt") as handle:
        names = set(handle.keys())
    assert {"model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.v_scale"} <= names
    assert_published_model_matches_base(path, tiny_model, "LlamaForCausalLM")
