"""The preset registry: every preset renders and validates, does what the registry claims on a
CPU-only worker, and is listed in docs/recipes.md exactly as the registry says.

GPU-only presets are checked as far as a CPU worker can: rendered, validated, refused with the
reason, and traced on the meta model once that refusal is set aside. CPU presets run end to end
in tests/matrix/test_cpu_presets.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from support.recipes import BF16_PRESETS
from support.stand_ins import no_hardware_check

from compressflow.errors import RecipeError
from compressflow.flows.validate import validate
from compressflow.model.hardware import NEEDS_ACCELERATOR, accelerator
from compressflow.params import RecipeArgs
from compressflow.recipes.render import render
from compressflow.recipes.tree import iter_modifiers
from compressflow.registries.presets import (
    KV_CACHE_FP8,
    PRESETS,
    TABLE_COLUMNS,
    markdown_table,
    preset_rows,
    resolve_args,
)

RECIPES_PAGE = Path(__file__).resolve().parents[2] / "docs" / "recipes.md"
GPU_PRESETS = [name for name, preset in PRESETS.items() if not preset.cpu_ok]


def quantizing_modifier(rendered) -> dict:
    """The arguments of the rendered recipe's modifier that quantizes (the one with a scheme)."""
    recipe = yaml.safe_load(rendered.yaml)
    [kwargs] = [k for _, _, k in iter_modifiers(recipe) if "scheme" in k or "config_groups" in k]
    return kwargs


# ---------------------------------------------------------------- every preset


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_renders_validates_and_needs_the_data_it_claims(name):
    preset = PRESETS[name]
    rendered = render(RecipeArgs(preset=name))
    assert rendered.source == f"preset:{name}"
    assert rendered.needs_data == preset.needs_data
    assert rendered.pipeline == ("sequential" if preset.needs_data else "datafree")
    assert quantizing_modifier(rendered)["kv_cache_scheme"] is None
    assert preset.vllm_gpus and preset.description.endswith(".")
    assert all(p.doc for p in preset.placeholders.values())


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_takes_the_fp8_kv_cache_which_needs_data(name):
    rendered = render(
        RecipeArgs(preset=name, recipe_args=resolve_args(name, {"kv_cache_scheme": "fp8"}))
    )
    assert quantizing_modifier(rendered)["kv_cache_scheme"] == KV_CACHE_FP8
    assert rendered.needs_data and rendered.pipeline == "sequential"


def test_kv_cache_fp8_is_a_name_recipe_args_take():
    """Needs compressflow.recipes.placeholders.effective_args to return its values through resolve_args."""
    rendered = render(RecipeArgs(preset="FP8_DYNAMIC", recipe_args={"kv_cache_scheme": "fp8"}))
    assert quantizing_modifier(rendered)["kv_cache_scheme"] == KV_CACHE_FP8
    assert rendered.args["kv_cache_scheme"] == KV_CACHE_FP8


def test_an_unknown_kv_cache_name_is_refused_with_the_names():
    with pytest.raises(RecipeError) as raised:
        resolve_args("W4A16", {"kv_cache_scheme": "fp16"})
    assert raised.value.field == "recipe.recipe_args"
    assert "fp16" in str(raised.value) and "fp8" in raised.value.fix
    mapping = {**KV_CACHE_FP8, "strategy": "attn_head"}  # full mappings pass as given
    assert resolve_args("W4A16", {"kv_cache_scheme": mapping}) == {"kv_cache_scheme": mapping}


def test_recipe_kv_cache_fp8_sets_the_presets_placeholder_and_so_the_run_key():
    plain = render(RecipeArgs(preset="FP8_DYNAMIC"))
    rendered = render(RecipeArgs(preset="FP8_DYNAMIC", kv_cache="fp8"))
    assert quantizing_modifier(rendered)["kv_cache_scheme"] == KV_CACHE_FP8
    assert rendered.args["kv_cache_scheme"] == rendered.kv_cache_scheme == KV_CACHE_FP8
    assert rendered.needs_data and not plain.needs_data  # its scales are calibrated
    assert plain.kv_cache_scheme is None and rendered.sha256 != plain.sha256
    # recipe_args asking for the same scheme, by name or in full, agree with it.
    for same in ("fp8", KV_CACHE_FP8):
        args = RecipeArgs(preset="W4A16", kv_cache="fp8", recipe_args={"kv_cache_scheme": same})
        assert quantizing_modifier(render(args))["kv_cache_scheme"] == KV_CACHE_FP8


def test_recipe_kv_cache_and_another_kv_cache_scheme_in_recipe_args_is_refused():
    other = {**KV_CACHE_FP8, "strategy": "attn_head"}
    args = RecipeArgs(preset="W4A16", kv_cache="fp8", recipe_args={"kv_cache_scheme": other})
    with pytest.raises(RecipeError) as raised:
        render(args)
    assert raised.value.field == "recipe.kv_cache"
    assert "recipe.recipe_args sets kv_cache_scheme" in raised.value.problem
    assert "attn_head" in raised.value.problem and "recipe.kv_cache off" in raised.value.fix


@pytest.mark.parametrize("name", list(PRESETS))
def test_gpu_only_exactly_where_the_worker_check_refuses(name):
    """The registry's cpu_ok agrees with the modifiers compressflow.model.hardware refuses on CPU."""
    rendered = render(RecipeArgs(preset=name))
    assert PRESETS[name].cpu_ok == (not set(rendered.modifiers) & set(NEEDS_ACCELERATOR))


# ---------------------------------------------------------------- the listing and the docs


def test_listing_has_a_row_per_preset_with_gpu_only_marked():
    rows = preset_rows()
    assert [row["preset"] for row in rows] == list(PRESETS)
    for row in rows:
        preset = PRESETS[row["preset"]]
        assert set(row) == {"preset", "what", "placeholders", "data", "vllm_gpus", "cpu_worker"}
        assert all(f"{key}=" in row["placeholders"] for key in preset.placeholders)
        assert row["cpu_worker"] == "yes" if preset.cpu_ok else row["cpu_worker"].startswith("no: ")


def table_rows(text: str) -> list[list[str]]:
    """The cells of a Markdown table's body rows (header and separator dropped)."""
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("|")]
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines[2:]]


def test_docs_recipes_table_is_the_registry():
    section = RECIPES_PAGE.read_text(encoding="utf-8").split("\n## Recipes\n", 1)[1]
    section = section.split("\n## ", 1)[0]
    table = section[section.index("| preset |") :].split("\n\n", 1)[0]
    assert table.splitlines()[0] == "| " + " | ".join(TABLE_COLUMNS) + " |"
    rows = table_rows(table)
    assert [row[0].strip("`") for row in rows] == list(PRESETS), (
        "docs/recipes.md's preset table lists other presets than the registry; paste "
        "compressflow.registries.presets.markdown_table() into docs/recipes.md's ## Recipes"
    )
    assert rows == table_rows(markdown_table()), "docs/recipes.md's preset table is out of date"


# ---------------------------------------------------------------- GPU-only presets on CPU


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_gpu_only_preset_is_refused_here_and_passes_every_other_check(
    name, tiny_model, tmp_path, monkeypatch
):
    params = dict(
        model={"model_id": str(tiny_model)},
        dataset={"dataset_name": "python_docs", "text_samples": 8, "max_seq_len": 64},
        recipe={"preset": name},
        output={"save_directory": str(tmp_path / "out")},
    )
    if accelerator() is None:
        with pytest.raises(RecipeError, match="needs a CUDA GPU worker"):
            validate(**params)
    # What a GPU worker checks beyond the hardware, without weights: the trace on the meta model.
    monkeypatch.setattr("compressflow.flows.checks.refuse_unsupported", no_hardware_check)
    checks = {check.name: check.detail for check in validate(**params).checks}
    if PRESETS[name].needs_data:
        assert re.search(r"\d+ subgraphs", checks["traceability"]), checks
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", sorted(BF16_PRESETS))
def test_fp4_preset_on_a_float32_model_is_refused_before_weights_load(name, tiny_model, tmp_path):
    with pytest.raises(RecipeError, match="needs a bf16 or fp16 model"):
        validate(
            model={"model_id": str(tiny_model)},
            dataset={"dataset_name": "python_docs", "text_samples": 8, "max_seq_len": 64},
            recipe={"preset": name},
            output={"save_directory": str(tmp_path / "out")},
        )
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- the CLI's listing


def test_the_cli_lists_every_preset_with_its_hardware(capsys):
    from compressflow.flows.cli import main
    from compressflow.registries.presets import PRESETS

    assert main(["presets"]) == 0
    listed = capsys.readouterr().out
    for name, preset in PRESETS.items():
        assert f"{name}: " in listed
        assert preset.vllm_gpus in listed
    assert "CPU worker here: no" in listed  # AWQ is marked GPU-only


# ---------------------------------------------------------------- structural methods


def modifiers_of(rendered) -> list[tuple[str, dict]]:
    return [(name, kwargs) for _, name, kwargs in iter_modifiers(yaml.safe_load(rendered.yaml))]


def test_w4a16_quip_rotates_as_llm_compressors_example_then_quantizes_with_gptq():
    rendered = render(RecipeArgs(preset="W4A16_QUIP", recipe_args={"ignore": ["lm_head", "x"]}))
    [(quip, rotation), (gptq, quantization)] = modifiers_of(rendered)
    assert (quip, gptq) == ("QuIPModifier", "GPTQModifier")
    assert rotation["transform_type"] == "hadamard" and rotation["transform_block_size"] == 128
    assert rotation["rotations"] == ["v"] and quantization["scheme"] == "W4A16"
    assert rotation["ignore"] == quantization["ignore"] == ["lm_head", "x"]  # one `ignore`


@pytest.mark.parametrize("preset", ["W4A16", "FP8_DYNAMIC", "W4A16_QUIP"])
def test_prune_experts_adds_a_reap_stage_before_the_presets_quantization(preset):
    rendered = render(RecipeArgs(preset=preset, prune_experts=0.25))
    assert rendered.modifiers[0] == "REAPPruningModifier"
    assert modifiers_of(rendered)[0][1] == {"sparsity": 0.25}
    assert rendered.modifiers[1:] == render(RecipeArgs(preset=preset)).modifiers
    assert rendered.needs_data and rendered.pipeline == "sequential"  # REAP routes samples
    assert "REAPPruningModifier" not in render(RecipeArgs(preset=preset)).yaml  # 0: off


def test_prune_experts_goes_before_your_own_recipe_and_refuses_a_second_reap():
    own = {"quant_stage": {"quant_modifiers": {"QuantizationModifier": {"scheme": "W8A8"}}}}
    rendered = render(RecipeArgs(recipe=own, prune_experts=0.5))
    assert rendered.modifiers == ["REAPPruningModifier", "QuantizationModifier"]
    reap = {"s_stage": {"s_modifiers": {"REAPPruningModifier": {"sparsity": 0.25}}}, **own}
    with pytest.raises(RecipeError) as raised:
        render(RecipeArgs(recipe=reap, prune_experts=0.5))
    assert raised.value.field == "recipe.prune_experts"
    assert "s_stage.s_modifiers" in raised.value.problem and "0" in raised.value.fix


@pytest.mark.parametrize("fraction", [-0.1, 1, 1.5, float("nan")])
def test_prune_experts_outside_zero_to_one_is_refused_by_the_form(fraction):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="prune_experts"):
        RecipeArgs(preset="W4A16", prune_experts=fraction)


def params(model: Path, tmp_path: Path, **recipe) -> dict:
    return dict(
        model={"model_id": str(model)},
        dataset={"dataset_name": "python_docs", "text_samples": 8, "max_seq_len": 64},
        recipe=recipe,
        output={"save_directory": str(tmp_path / "out")},
    )


@pytest.fixture(scope="module")
def tiny_mixtral(zoo_root) -> Path:
    from compressflow.demo.zoo import build_tiny

    return build_tiny("mixtral", zoo_root)  # 4 experts a layer, the router picks 2


@pytest.mark.parametrize(
    "fraction, words",
    [
        (0.1, "drops no expert of 4 (num_local_experts)"),
        (0.75, "leaves 1 expert(s) reachable of 4 (num_local_experts), fewer than the 2"),
    ],
)
def test_prune_experts_that_reap_would_refuse_after_loading_is_refused_first(
    tiny_mixtral, tmp_path, fraction, words
):
    with pytest.raises(RecipeError) as raised:
        validate(**params(tiny_mixtral, tmp_path, preset="W4A16", prune_experts=fraction))
    assert raised.value.field == "recipe.prune_experts" and words in raised.value.problem
    assert "from 0.25 (one expert) up to below 0.75" in raised.value.fix
    assert not (tmp_path / "out").exists()
    validate(**params(tiny_mixtral, tmp_path, preset="W4A16", prune_experts=0.5))  # keeps 2


def test_prune_experts_on_a_dense_model_is_refused_before_calibration(tiny_model, tmp_path):
    with pytest.raises(RecipeError) as raised:
        validate(**params(tiny_model, tmp_path, preset="W4A16", prune_experts=0.25))
    assert raised.value.field == "recipe.prune_experts"
    assert "is dense" in raised.value.problem and "num_local_experts" in raised.value.problem
    # The same refusal for a REAP of the user's own recipe, naming the recipe.
    own = {"p_stage": {"p_modifiers": {"REAPPruningModifier": {"sparsity": 0.25}}}}
    with pytest.raises(RecipeError, match="is dense") as raised:
        validate(**params(tiny_model, tmp_path, recipe=own))
    assert raised.value.field == "recipe.recipe"
    assert not (tmp_path / "out").exists()


def test_a_rotation_a_layers_width_cannot_take_is_refused_naming_the_layer(tmp_path):
    import torch
    from safetensors.torch import save_file

    from compressflow.model.methods_fit import refuse_unrotatable

    save_file(
        {
            "model.layers.0.mlp.down_proj.weight": torch.zeros(128, 96),
            "model.layers.0.mlp.up_proj.weight": torch.zeros(96, 128),
            "lm_head.weight": torch.zeros(10, 96),
        },
        str(tmp_path / "model.safetensors"),
    )
    quip = {"transform_type": "hadamard", "transform_block_size": 128, "ignore": "lm_head"}
    with pytest.raises(RecipeError) as raised:
        refuse_unrotatable(tmp_path, quip, "recipe.preset")
    assert "1 layer(s)" in raised.value.problem and "down_proj (96)" in raised.value.problem
    assert "a multiple of its Hadamard block, 128" in raised.value.problem
    refuse_unrotatable(tmp_path, {**quip, "transform_block_size": 32}, "recipe.preset")
    refuse_unrotatable(tmp_path, {**quip, "ignore": ["lm_head", "re:.*down_proj"]}, "x")
    with pytest.raises(RecipeError, match="power of two"):  # no block: the whole width
        refuse_unrotatable(tmp_path, {**quip, "transform_block_size": None}, "recipe.preset")
