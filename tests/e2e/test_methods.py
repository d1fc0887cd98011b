"""Every method llm-compressor 0.14 ships, through the compress flow and its verify stage: a
valid output of each is published (rotations add the transforms their transform_config
declares; expert pruning drops whole experts, with the router and config.json agreeing), and
verify still refuses what a method's contract does not allow (tests/unit/test_verify.py tampers
with staged outputs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compressflow.demo.zoo import build_tiny, model_class
from compressflow.evaluation.quality import load_causal_lm, score
from compressflow.flows.compress import compress
from compressflow.model.headers import tensor_index
from compressflow.params import DatasetArgs, ModelArgs, OutputArgs, RecipeArgs, VerifyArgs

pytestmark = pytest.mark.usefixtures("prefect_harness")

# As llm-compressor's examples write them (examples/transform/quip_example.py; reap).
QUIP_W4A16 = """
quant_stage:
  quant_modifiers:
    QuIPModifier: {rotations: [v], transform_type: random-hadamard, targets: [Linear], ignore: [lm_head]}
    GPTQModifier: {targets: [Linear], scheme: W4A16, ignore: [lm_head]}
"""
REAP = """
prune_stage:
  prune_modifiers:
    REAPPruningModifier: {sparsity: 0.25}
"""


def run(source: Path, model_class: str, recipe: str, tmp_path: Path):
    target = tmp_path / "out"
    published = compress(
        model=ModelArgs(model_id=str(source), model_class=model_class),
        dataset=DatasetArgs(dataset_name="python_docs", text_samples=16, max_seq_len=64),
        recipe=RecipeArgs(recipe=recipe),
        output=OutputArgs(save_directory=str(target)),
        verify=VerifyArgs(vllm="off"),
    )
    return source, target, published


def checks_of(target: Path) -> dict[str, dict]:
    manifest = json.loads((target / "manifest.json").read_text())
    return {check["name"]: check for check in manifest["verification"]["checks"]}


def test_quip_rotations_with_gptq_publish_with_their_transforms(tiny_model, tmp_path):
    # The tiny Llama: on the tiny random Qwen2, GPTQ W4A16 alone (KL 0.33) misses the 4-bit
    # limits as QuIP + GPTQ does (0.32): random weights, not the rotation.
    source, target, published = run(tiny_model, "LlamaForCausalLM", QUIP_W4A16, tmp_path)
    config = json.loads((target / "config.json").read_text())
    assert config["quantization_config"]["transform_config"]["config_groups"]["v"]
    added = sorted(set(tensor_index(target)) - set(tensor_index(source)))
    assert any(name.endswith(".v_input.weight") for name in added)
    names = checks_of(target)["tensor names"]
    assert names["passed"] and "transform" in names["detail"]
    # Evaluation loads it with its rotation too (the one loader): without the transforms its
    # KL to the base was 8.4 here, and the yardstick's held-out perplexity 3,288 against 42.
    base = load_causal_lm(str(source), "LlamaForCausalLM", False)
    rotated = load_causal_lm(str(target), "LlamaForCausalLM", False)
    figures = score(base, rotated, [list(range(1, 64)), list(range(64, 128))])
    logits = checks_of(target)["logits"]
    assert figures.kl_divergence < 1.0, (figures, logits["detail"])


def test_reap_expert_pruning_publishes_the_kept_experts(zoo_root, tmp_path):
    source = build_tiny("mixtral", zoo_root)
    source, target, published = run(source, model_class("mixtral"), REAP, tmp_path)
    config = json.loads((target / "config.json").read_text())
    assert config["num_local_experts"] == 3  # 4 less a quarter
    saved = tensor_index(target)
    assert saved["model.layers.0.block_sparse_moe.gate.weight"].shape == (3, 128)
    assert not any(".experts.3." in name for name in saved)
    names = checks_of(target)["tensor names"]
    assert names["passed"] and "expert" in names["detail"]
