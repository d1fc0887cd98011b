"""Each method's structural contract (compressflow/recipes/kinds.py) as verify's tensor names
check holds a staged output to it: what the method may change passes, anything else is refused,
naming the tensor. Outputs are the tiny models' own tensors, tampered with as each method (or a
broken save) would; tests/e2e/test_methods.py runs the methods themselves through the flow.
(A file of its own: tests/unit/test_verify.py is near the 600-line bound.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from compressflow.demo.zoo import build_tiny
from compressflow.errors import RecipeError
from compressflow.params import RecipeArgs, VerifyArgs
from compressflow.recipes.kinds import contract_of
from compressflow.recipes.render import render
from compressflow.registries.thresholds import DEFAULTS
from compressflow.verification.logits import limits_source
from compressflow.verification.names import check_names

REAP = [{"REAPPruningModifier": {"sparsity": 0.25}}]
QUANTIZE = {"QuantizationModifier": {"targets": "Linear", "scheme": "W8A8", "ignore": ["lm_head"]}}
QUIP = [{"QuIPModifier": {"rotations": ["v"], "ignore": ["lm_head"]}}, QUANTIZE]
V_INPUT = {
    "config_groups": {
        "v": {
            "type": "random-hadamard",
            "apply": [
                {"targets": ["Linear"], "ignore": ["lm_head"], "location": "input"},
                {"targets": ["Linear"], "ignore": ["lm_head"], "location": "weight_input"},
            ],
        }
    }
}
MOE = "model.layers.{}.block_sparse_moe"


def contract(modifiers: list[dict]):
    return contract_of(yaml.safe_load(render(RecipeArgs(recipe=yaml.safe_dump(modifiers))).yaml))


def edited(source: Path, folder: Path, change, config_change=None) -> Path:
    """A copy of `source` whose tensors `change` edits in place (and config.json)."""
    shutil.copytree(source, folder)
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    (config_change or (lambda c: None))(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def prune(tensors: dict, keep: int = 3, layers=(0, 1)) -> None:
    """What REAP saves: experts past `keep` gone (the kept ones renumbered 0..keep-1), the
    router one row per kept expert."""
    for layer in layers:
        moe = MOE.format(layer)
        for name in [n for n in tensors if n.startswith(f"{moe}.experts.")]:
            if int(name.split(".")[5]) >= keep:
                del tensors[name]
        tensors[f"{moe}.gate.weight"] = tensors[f"{moe}.gate.weight"][:keep].clone()


def kept(count: int):
    return lambda config: config.update(num_local_experts=count)


@pytest.fixture(scope="module")
def mixtral(zoo_root) -> Path:
    return build_tiny("mixtral", zoo_root)  # 4 experts, 2 MoE layers


def test_reap_may_drop_whole_experts_with_the_router_and_count(mixtral, tmp_path):
    output = edited(mixtral, tmp_path / "out", prune, kept(3))
    check = check_names(output, mixtral, "MixtralForCausalLM", contract=contract(REAP))
    assert check.passed, check.detail
    assert "2 MoE layer(s) pruned 4 -> 3 experts (config.json num_local_experts)" in check.detail
    # Today's refusal without expert pruning in the recipe: the same output is not quantization.
    check = check_names(output, mixtral, "MixtralForCausalLM", contract=contract([QUANTIZE]))
    assert not check.passed and f"{MOE.format(0)}.gate.weight [3, 128] saved" in check.detail


def extra(tensors):
    tensors[f"{MOE.format(0)}.experts.0.w1.extra"] = torch.ones(2)


def lost_norm(tensors):
    del tensors["model.layers.1.post_attention_layernorm.weight"]


def half_an_expert(tensors):
    del tensors[f"{MOE.format(1)}.experts.0.w2.weight"]


def router_rows(tensors):
    gate = tensors[f"{MOE.format(0)}.gate.weight"]
    tensors[f"{MOE.format(0)}.gate.weight"] = torch.cat([gate, gate[:1]])  # 4 rows for 3


def pruned_expert_kept(tensors):
    tensors[f"{MOE.format(0)}.experts.3.w1.weight"] = tensors[
        f"{MOE.format(0)}.experts.0.w1.weight"
    ].clone()


@pytest.mark.parametrize(
    ("tamper", "count", "named"),
    [
        (extra, 3, "experts.0.w1.extra"),
        (lost_norm, 3, "model.layers.1.post_attention_layernorm.weight"),
        (half_an_expert, 3, "experts.0.w2.weight"),
        (router_rows, 3, "block_sparse_moe.gate.weight [4, 128] saved, [3, 128] expected"),
        (pruned_expert_kept, 3, "experts.3.w1.weight"),
        (None, 4, "config.json num_local_experts is 4, but the MoE layers keep [3] experts"),
    ],
)
def test_what_reap_does_not_do_is_refused_naming_the_tensor(
    mixtral, tmp_path, tamper, count, named
):
    def change(tensors):
        prune(tensors)
        (tamper or (lambda t: None))(tensors)

    output = edited(mixtral, tmp_path / "out", change, kept(count))
    check = check_names(output, mixtral, "MixtralForCausalLM", contract=contract(REAP))
    assert not check.passed and named in check.detail, check.detail


def test_an_ignored_moe_layer_keeps_every_expert(mixtral, tmp_path):
    output = edited(mixtral, tmp_path / "out", lambda t: prune(t, layers=(0, 1)), kept(3))
    reap = [{"REAPPruningModifier": {"sparsity": 0.25, "ignore": [r"layers\.1\."]}}]
    check = check_names(output, mixtral, "MixtralForCausalLM", contract=contract(reap))
    assert not check.passed and "experts.3" in check.detail


def with_transform(name: str):
    def change(tensors):
        tensors[name] = torch.eye(4)

    return change


def declare(transform_config: dict):
    return lambda config: config.update(quantization_config={"transform_config": transform_config})


def test_a_rotation_may_add_the_transforms_its_config_declares(tiny_model, tmp_path):
    name = "model.layers.0.mlp.down_proj.v_input.weight"
    output = edited(tiny_model, tmp_path / "out", with_transform(name), declare(V_INPUT))
    check = check_names(output, tiny_model, contract=contract(QUIP))
    assert check.passed and "1 transform tensor(s) its transform_config declares" in check.detail
    # Quantization alone adds no transform, declared or not.
    assert not check_names(output, tiny_model, contract=contract([QUANTIZE])).passed


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.mlp.down_proj.u_input.weight",  # a group it does not declare
        "model.layers.0.mlp.down_proj.v_weight_input.weight",  # fused: never saved
        "lm_head.v_input.weight",  # a module its ignore leaves out
        "model.layers.0.mlp.nowhere.v_input.weight",  # no source module
    ],
)
def test_a_transform_the_config_does_not_declare_is_refused(tiny_model, tmp_path, name):
    output = edited(tiny_model, tmp_path / "out", with_transform(name), declare(V_INPUT))
    check = check_names(output, tiny_model, contract=contract(QUIP))
    assert not check.passed and name in check.detail
    assert "not a transform config.json's transform_config declares" in check.detail


def test_spinquant_r1_r2_fuses_into_the_weights_and_adds_nothing(tiny_model, tmp_path):
    spinquant = [{"SpinQuantModifier": {"rotations": ["R1", "R2"]}}, QUANTIZE]
    fused = {"config_groups": {"R1": {"type": "hadamard", "apply": [
        {"targets": ["Linear"], "location": "weight_input"},
        {"targets": ["Linear"], "location": "weight_output"},
    ]}}}  # fmt: skip
    output = edited(tiny_model, tmp_path / "out", lambda t: None, declare(fused))
    assert check_names(output, tiny_model, contract=contract(spinquant)).passed
    name = "model.layers.0.mlp.down_proj.R1_weight_input.weight"
    tampered = edited(tiny_model, tmp_path / "tampered", with_transform(name), declare(fused))
    check = check_names(tampered, tiny_model, contract=contract(spinquant))
    assert not check.passed and name in check.detail


@pytest.mark.parametrize(
    "modifier",
    [
        {"SparseGPTModifier": {"sparsity": 0.5, "mask_structure": "2:4"}},
        {"WandaPruningModifier": {"sparsity": 0.5}},
        {"MagnitudePruningModifier": {"init_sparsity": 0.1, "final_sparsity": 0.5}},
    ],
)
def test_a_sparsity_stage_is_refused_at_render_naming_vllm(modifier):
    with pytest.raises(RecipeError) as caught:
        render(RecipeArgs(recipe=yaml.safe_dump([modifier, QUANTIZE])))
    message = str(caught.value)
    assert caught.value.field == "recipe.recipe" and next(iter(modifier)) in message
    assert "Sparsity support has been removed from compressed-tensors" in message
    assert "Fix: drop the" in message


def test_a_sparsity_refusal_comes_before_the_order_check():
    # Quantize, then prune the same layers: the order check would refuse it; sparsity first.
    prune = {"SparseGPTModifier": {"sparsity": 0.5, "targets": "Linear", "ignore": ["lm_head"]}}
    quantize = {"GPTQModifier": {"targets": "Linear", "scheme": "W4A16", "ignore": ["lm_head"]}}
    with pytest.raises(RecipeError, match="prunes weights to sparsity"):
        render(RecipeArgs(recipe=yaml.safe_dump([quantize, prune])))


def test_what_zeroes_nothing_is_not_a_sparsity_stage():
    # ConstantPruning keeps weights already zero at zero; a pruner asked for no sparsity prunes
    # none: neither changes what the output is.
    render(
        RecipeArgs(
            recipe=yaml.safe_dump([{"ConstantPruningModifier": {"targets": "__ALL__"}}, QUANTIZE])
        )
    )
    render(RecipeArgs(recipe=yaml.safe_dump([{"SparseGPTModifier": {"sparsity": 0.0}}, QUANTIZE])))


def test_the_logits_limits_take_the_method_and_say_which_they_used():
    assert contract(QUIP).method() == "rotation"
    assert contract(REAP).method() == "expert pruning"
    assert contract([QUANTIZE]).method() is None
    # The rotation's own limits are tighter than the 4-bit family's: W4A16 keeps the family's.
    assert VerifyArgs().logit_limits("W4A16", "rotation") == DEFAULTS["4-bit weights"]
    source = limits_source(VerifyArgs(), "W4A16", "rotation")
    assert source == (
        "the rotation default (W4A16), loosened to the 4-bit weights default where that is looser"
    )
    source = limits_source(VerifyArgs(), "W4A16", "rotation+expert pruning")
    assert source.endswith("as no rotation+expert pruning default is measured yet")
