"""Stage order by kind and layer (compressflow/recipes/kinds.py, order.py) and `re:` patterns.

A forbidden order (quantize, then prune, smooth or rotate) is refused only where both modifiers
touch a common layer of the model; the same pair on disjoint layers, or in the library's order,
passes. llm-compressor's own non-uniform example must pass.
"""

from __future__ import annotations

import json

import pytest
import yaml

from compressflow import compat
from compressflow.errors import RecipeError
from compressflow.model.modules import header_modules, meta_modules
from compressflow.params import RecipeArgs
from compressflow.recipes import order
from compressflow.recipes.kinds import KIND_OF, KINDS
from compressflow.recipes.render import fill, render
from compressflow.results import FetchedModel

ATTENTION = r"re:.*self_attn\.(k|q|o|v)_proj$"
MLP = r"re:.*mlp\.(down|gate|up)_proj$"

# examples/quantization_non_uniform/quantization_multiple_modifiers.py (llm-compressor), as YAML:
# GPTQ W8A8 on the attention projections, then AWQ smoothing and W4A16 on the MLP.
NON_UNIFORM = [
    {"GPTQModifier": {"targets": ATTENTION, "scheme": "W8A8"}},
    {
        "AWQModifier": {
            "mappings": [
                {
                    "smooth_layer": "re:.*post_attention_layernorm$",
                    "balance_layers": ["re:.*gate_proj$", "re:.*up_proj$"],
                },
                {"smooth_layer": "re:.*up_proj$", "balance_layers": ["re:.*down_proj$"]},
            ]
        }
    },
    {"QuantizationModifier": {"targets": MLP, "scheme": "W4A16"}},
]
QUANTIZE = {"GPTQModifier": {"targets": "Linear", "scheme": "W4A16", "ignore": ["lm_head"]}}
# A sparsity stage is refused at render whatever its order (tests/unit/test_method_contracts.py):
# the kind that may not follow quantization on the same layers here is a rotation.
ROTATE = {"QuIPModifier": {"rotations": ["v"], "targets": ["Linear"], "ignore": ["lm_head"]}}


def on(modifier: dict, targets) -> dict:
    """`modifier` aimed at `targets` instead."""
    ((name, kwargs),) = modifier.items()
    return {name: {**kwargs, "targets": targets}}


def text(modifiers: list[dict]) -> str:
    return yaml.safe_dump(modifiers, sort_keys=False)


def fetched(path) -> FetchedModel:
    return FetchedModel(
        model_id=str(path), path=str(path), source="local", identity="sha256:x", size_bytes=1
    )


def check(modifiers: list[dict], tiny_model, meta: bool = False) -> None:
    """What adapt-recipe runs: render, then the order on the tiny model's layers."""
    rendered = render(RecipeArgs(recipe=text(modifiers)))
    architecture = json.loads((tiny_model / "config.json").read_text())["architectures"][0]
    if meta:
        modules, architecture = meta_modules(fetched(tiny_model))
    else:
        modules = header_modules(tiny_model)
    assert order.check_model(rendered.yaml, modules, architecture, meta)


def test_every_modifier_class_has_one_kind():
    assert sorted(KIND_OF) == sorted(compat.modifier_classes())
    for kind in KINDS.values():
        assert set(kind.followers) <= set(KINDS), kind.name


def test_library_orders_stay_allowed():
    for first, second in [
        ("SparseGPTModifier", "GPTQModifier"),
        ("SmoothQuantModifier", "GPTQModifier"),
        ("AWQModifier", "QuantizationModifier"),
        ("SpinQuantModifier", "QuantizationModifier"),
        ("QuIPModifier", "QuantizationModifier"),
        ("REAPPruningModifier", "GPTQModifier"),
        ("GPTQModifier", "QuantizationModifier"),  # a KV-cache scheme after the attention's
        ("SparseGPTModifier", "ConstantPruningModifier"),
    ]:
        assert not order.forbidden(first, second), (first, second)


def test_llm_compressor_non_uniform_example_passes(tiny_model):
    check(NON_UNIFORM, tiny_model)
    check(NON_UNIFORM, tiny_model, meta=True)


def test_smoothing_after_quantizing_the_same_layers_is_refused(tiny_model):
    recipe = [NON_UNIFORM[0], {"AWQModifier": {}}, NON_UNIFORM[2]]  # AWQ's own mappings
    with pytest.raises(RecipeError) as caught:
        check(recipe, tiny_model, meta=True)
    message = str(caught.value)
    assert "AWQModifier (stage" in message and "GPTQModifier (stage" in message
    assert "self_attn" in message and "put AWQModifier before GPTQModifier" in message


@pytest.mark.parametrize("meta", [False, True])
def test_rotating_what_was_quantized_is_refused_and_the_other_order_passes(tiny_model, meta):
    # Written differently (render cannot tell), overlapping on the model: the q projections.
    with pytest.raises(RecipeError) as caught:
        check([on(QUANTIZE, ATTENTION), on(ROTATE, "re:.*q_proj$")], tiny_model, meta)
    message = str(caught.value)
    assert "QuIPModifier (stage" in message and "rotates weights" in message
    assert "2 common layer(s): model.layers.0.self_attn.q_proj" in message
    assert "put QuIPModifier before GPTQModifier" in message
    check([on(ROTATE, "re:.*q_proj$"), on(QUANTIZE, ATTENTION)], tiny_model, meta)


@pytest.mark.parametrize("meta", [False, True])
def test_rotating_a_decoder_layer_by_name_touches_the_layers_inside_it(tiny_model, meta):
    # A target may name a decoder layer (llm-compressor's own SparseGPT test recipes do): the
    # headers name no tensor there, yet its projections were quantized first.
    with pytest.raises(RecipeError, match=r"model\.layers\.0\.self_attn\.k_proj"):
        check([on(QUANTIZE, ATTENTION), on(ROTATE, r"re:.*layers\.0$")], tiny_model, meta)
    check([on(ROTATE, r"re:.*layers\.0$"), on(QUANTIZE, ATTENTION)], tiny_model, meta)


@pytest.mark.parametrize("meta", [False, True])
def test_the_same_pair_on_disjoint_layers_passes_in_both_orders(tiny_model, meta):
    check([on(QUANTIZE, ATTENTION), on(ROTATE, MLP)], tiny_model, meta)
    check([on(ROTATE, MLP), on(QUANTIZE, ATTENTION)], tiny_model, meta)


def test_a_class_target_headers_cannot_tell_needs_the_meta_model(tiny_model):
    recipe = [on(QUANTIZE, ["LlamaDecoderLayer"]), on(ROTATE, ATTENTION)]
    rendered = render(RecipeArgs(recipe=text(recipe)))
    assert not order.check_model(rendered.yaml, header_modules(tiny_model), "", False)
    with pytest.raises(RecipeError, match="self_attn"):  # the decoder layer holds them
        check(recipe, tiny_model, meta=True)


def test_the_same_written_targets_are_refused_without_a_model():
    with pytest.raises(RecipeError, match="both touch the same layers"):
        render(RecipeArgs(recipe=text([QUANTIZE, ROTATE])))
    with pytest.raises(RecipeError, match="QuIPModifier .* comes after GPTQModifier"):
        render(RecipeArgs(recipe=text([QUANTIZE, {"QuIPModifier": {"targets": "Linear"}}])))
    # Mappings say nothing about layers without the model: left to adapt-recipe.
    render(RecipeArgs(recipe=text([QUANTIZE, {"SmoothQuantModifier": {}}])))
    assert not order.may_conflict(yaml.safe_load(render(RecipeArgs(preset="W8A8")).yaml))


@pytest.mark.parametrize(
    "where",
    [
        {"GPTQModifier": {"targets": "re:[unclosed", "scheme": "W4A16"}},
        {"GPTQModifier": {"targets": "Linear", "scheme": "W4A16", "ignore": ["re:(lm_head"]}},
        {"SmoothQuantModifier": {"mappings": [[["re:.*q_proj"], "re:*norm"]]}},
        {"GPTQModifier": {"scheme": {"W4A16": ["re:+x"]}}},
    ],
)
def test_a_pattern_that_does_not_compile_is_refused_before_the_library(where):
    name = next(iter(where))
    with pytest.raises(RecipeError) as caught:
        fill(RecipeArgs(recipe=text([where])))  # precheck's part: no library imported
    message = str(caught.value)
    assert caught.value.field == "recipe.recipe" and name in message
    assert "not a regular expression Python can compile" in message and "position" in message


def test_a_sequential_target_that_does_not_compile_is_refused():
    with pytest.raises(RecipeError) as caught:
        fill(RecipeArgs(preset="W4A16", sequential_targets=["re:(("]))
    assert caught.value.field == "recipe.sequential_targets"
