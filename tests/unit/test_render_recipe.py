"""The render-recipe stage: every recipe form, placeholder substitution, legacy forms, and errors.

Fast: nothing loads a model. llm-compressor's parser runs on the rendered recipes (its import costs
a few seconds once); the property tests exercise `substitute` alone.
"""

from __future__ import annotations

import hashlib
import os
import re
import string

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from support.recipes import SEED_GUIDE_W4A16 as SEED_RECIPE
from support.recipes import SEED_GUIDE_W4A16_ARGS as SEED_ARGS

from compressflow.errors import RecipeError
from compressflow.params import RecipeArgs
from compressflow.recipes.placeholders import find_placeholders, substitute
from compressflow.registries.presets import KV_CACHE_FP8, PRESETS
from compressflow.tasks.render_recipe import render_recipe

GPTQ = {"targets": "Linear", "scheme": "W4A16", "ignore": ["lm_head"]}


def render(recipe, **kwargs):
    return render_recipe.fn(RecipeArgs(recipe=recipe, **kwargs))


def rendered_gptq(result) -> dict:
    """The GPTQModifier arguments of a rendered one-modifier recipe."""
    (stage,) = yaml.safe_load(result.yaml).values()
    (group,) = stage.values()
    return group["GPTQModifier"]


def mentions(message: str, name: str) -> bool:
    """Whether `name` appears in `message` as a whole word (so `a` is not found inside `ab`)."""
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", message) is not None


# ---------------------------------------------------------------- forms


@pytest.mark.parametrize(
    "name, modifiers, scheme, needs_data, pipeline",
    [
        ("W4A16", ["GPTQModifier"], "W4A16", True, "sequential"),
        ("w4a16", ["GPTQModifier"], "W4A16", True, "sequential"),
        ("w8a8", ["SmoothQuantModifier", "GPTQModifier"], "W8A8", True, "sequential"),
        ("FP8_DYNAMIC", ["QuantizationModifier"], "FP8_DYNAMIC", False, "datafree"),
        ("fp8-dynamic", ["QuantizationModifier"], "FP8_DYNAMIC", False, "datafree"),
    ],
)
def test_preset(name, modifiers, scheme, needs_data, pipeline):
    result = render(name)
    assert result.source == f"preset:{scheme}"
    assert (result.modifiers, result.scheme) == (modifiers, scheme)
    assert (result.needs_data, result.pipeline) == (needs_data, pipeline)
    assert result.sha256 == hashlib.sha256(result.yaml.encode()).hexdigest()


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_documents_exactly_its_placeholders(name):
    preset = PRESETS[name]
    assert find_placeholders(yaml.safe_load(preset.template)) == set(preset.placeholders)
    assert all(p.doc for p in preset.placeholders.values())
    assert render(name).args == preset.defaults()


def test_preset_defaults_and_overrides():
    defaults = rendered_gptq(render("W4A16"))
    assert (defaults["dampening_frac"], defaults["block_size"], defaults["ignore"]) == (
        0.01,
        128,
        ["lm_head"],
    )
    ignore = ["lm_head", "re:.*gate$"]
    result = render("W4A16", recipe_args={"dampening_frac": 0.05, "ignore": ignore})
    assert rendered_gptq(result)["dampening_frac"] == 0.05
    assert rendered_gptq(result)["ignore"] == ignore
    assert result.args == {
        "ignore": ignore,
        "dampening_frac": 0.05,
        "block_size": 128,
        "kv_cache_scheme": None,
    }


def test_preset_refuses_an_unknown_arg_and_lists_its_placeholders():
    with pytest.raises(RecipeError) as err:
        render("W8A8", recipe_args={"damp": 0.1})
    message = str(err.value)
    assert err.value.field == "recipe.recipe_args"
    for name in ["damp", *PRESETS["W8A8"].placeholders]:
        assert mentions(message, name)


def test_yaml_text_file_dict_and_list_render_the_same_modifier(tmp_path):
    text = yaml.safe_dump({"quant_stage": {"quant_modifiers": {"GPTQModifier": GPTQ}}})
    path = tmp_path / "recipe.yml"
    path.write_text(text)
    forms = [  # a dict or list is kept as YAML text: the one form the UI edits
        ("yaml", text),
        (f"file:{path}", str(path)),
        ("yaml", {"quant_stage": {"quant_modifiers": {"GPTQModifier": dict(GPTQ)}}}),
        ("yaml", [{"GPTQModifier": dict(GPTQ)}]),
    ]
    for source, recipe in forms:
        result = render(recipe)
        assert result.source == source
        assert (result.modifiers, result.scheme) == (["GPTQModifier"], "W4A16")
        assert result.pipeline == "sequential"
        assert rendered_gptq(result) == {**GPTQ}


def test_list_becomes_one_stage_in_order():
    result = render([{"SmoothQuantModifier": {"smoothing_strength": 0.5}}, {"GPTQModifier": GPTQ}])
    assert result.modifiers == ["SmoothQuantModifier", "GPTQModifier"]
    assert list(yaml.safe_load(result.yaml)) == ["default_stage"]


def test_yaml_text_that_is_a_list():
    result = render("- QuantizationModifier: {targets: Linear, scheme: FP8_DYNAMIC}\n")
    assert (result.source, result.modifiers) == ("yaml", ["QuantizationModifier"])
    assert not result.needs_data


def test_caller_recipe_is_not_changed():
    recipe = {"quant_stage": {"quant_modifiers": {"GPTQModifier": {**GPTQ, "observer": "$obs"}}}}
    before = yaml.safe_dump(recipe)
    render(recipe, recipe_args={"obs": "mse"})
    assert yaml.safe_dump(recipe) == before


# ---------------------------------------------------------------- the seed guide's example


def test_seed_w4a16_example_renders_exactly_and_parses():
    from llmcompressor.recipe import Recipe

    result = render(SEED_RECIPE, recipe_args=SEED_ARGS)
    assert yaml.safe_load(result.yaml) == {
        "quant_stage": {
            "quant_modifiers": {
                "GPTQModifier": {
                    "ignore": ["lm_head"],
                    "scheme": "W4A16",
                    "targets": "Linear",
                    "observer": {"weights": "mse"},
                    "dampening_frac": 0.1,
                }
            }
        }
    }
    assert len(result.notes) == 1 and "observer" in result.notes[0]
    assert (result.modifiers, result.pipeline) == (["GPTQModifier"], "sequential")
    # The text oneshot will get parses, and the observer reaches the weights' quantization args.
    (gptq,) = Recipe.create_instance(result.yaml).modifiers
    assert (gptq.dampening_frac, gptq.observer) == (0.1, {"weights": "mse"})
    assert gptq.resolved_config.config_groups["group_0"].weights.observer == "mse"


def test_legacy_observer_next_to_weight_observer_is_refused():
    recipe = [{"GPTQModifier": {**GPTQ, "observer": "mse", "weight_observer": "minmax"}}]
    with pytest.raises(RecipeError, match="weight_observer"):
        render(recipe)


def test_legacy_run_type_is_dropped_with_a_note():
    recipe = {"quant_stage": {"run_type": "oneshot", "quant_modifiers": {"GPTQModifier": GPTQ}}}
    result = render(recipe)
    assert "run_type" not in result.yaml
    assert any("run_type" in note for note in result.notes)


# ---------------------------------------------------------------- placeholders


def test_prefix_named_placeholders_do_not_collide():
    recipe = [
        {
            "GPTQModifier": {
                **GPTQ,
                "dampening_frac": "$dampening_frac",
                "block_size": "$damp",
                "ignore": ["lm_head", "layer_${damp}_x", "re:.*$damp_suffix"],
            }
        }
    ]
    result = render(recipe, recipe_args={"damp": 64, "dampening_frac": 0.02, "damp_suffix": "gate"})
    gptq = rendered_gptq(result)
    assert (gptq["dampening_frac"], gptq["block_size"]) == (0.02, 64)
    assert gptq["ignore"] == ["lm_head", "layer_64_x", "re:.*gate"]


def test_types_are_preserved():
    recipe = {
        "int": "$i",
        "float": "${f}",
        "list": "$l",
        "bool": "$b",
        "dict": "$d",
        "none": "$n",
        "nested": ["$i", {"deep": "$l"}],
        "embedded": "x-$i-${b}",
    }
    values = {"i": 3, "f": 0.5, "l": [1, "two", None], "b": False, "d": {"w": "mse"}, "n": None}
    assert substitute(recipe, values) == {
        "int": 3,
        "float": 0.5,
        "list": [1, "two", None],
        "bool": False,
        "dict": {"w": "mse"},
        "none": None,
        "nested": [3, {"deep": [1, "two", None]}],
        "embedded": "x-3-False",
    }


def test_types_reach_the_modifier():
    recipe = """
q_stage:
  q_modifiers:
    GPTQModifier:
      targets: $targets
      scheme: W4A16
      block_size: $block
      dampening_frac: $damp
      bypass_divisibility_checks: $bypass
      observer: $observer
"""
    values = {
        "targets": ["Linear"],
        "block": 64,
        "damp": 0.2,
        "bypass": True,
        "observer": {"weights": "minmax"},
    }
    result = render(recipe, recipe_args=values)
    assert rendered_gptq(result) == {
        "targets": ["Linear"],
        "scheme": "W4A16",
        "block_size": 64,
        "dampening_frac": 0.2,
        "bypass_divisibility_checks": True,
        "observer": {"weights": "minmax"},
    }
    assert result.notes == []  # a dict observer is already the 0.14 form


def test_a_value_used_twice_is_written_twice_not_as_a_yaml_alias():
    recipe = [
        {"SmoothQuantModifier": {"ignore": "$ignore"}},
        {"GPTQModifier": {**GPTQ, "ignore": "$ignore"}},
    ]
    result = render(recipe, recipe_args={"ignore": ["lm_head"]})
    assert "&" not in result.yaml and "*" not in result.yaml


def test_missing_placeholders_are_all_named():
    recipe = [{"GPTQModifier": {**GPTQ, "dampening_frac": "$damp", "block_size": "${block}"}}]
    with pytest.raises(RecipeError) as err:
        render(recipe)
    assert err.value.field == "recipe.recipe_args"
    assert mentions(str(err.value), "$damp") and mentions(str(err.value), "$block")


def test_unused_recipe_args_are_all_named_with_the_existing_placeholders():
    recipe = [{"GPTQModifier": {**GPTQ, "dampening_frac": "$damp"}}]
    with pytest.raises(RecipeError) as err:
        render(recipe, recipe_args={"damp": 0.1, "blok": 64, "extra": 1})
    message = str(err.value)
    assert mentions(message, "blok") and mentions(message, "extra") and mentions(message, "$damp")


def test_a_misspelt_arg_is_reported_as_missing_and_unused_with_a_suggestion():
    with pytest.raises(RecipeError) as err:
        render(SEED_RECIPE, recipe_args={"observr": "mse", "damp": 0.1})
    assert "$observer" in err.value.problem and "observr" in err.value.problem
    assert "observr -> observer" in err.value.fix


def test_dollar_not_followed_by_a_name_is_left_alone():
    ignore = ["re:.*lm_head$", "re:^model$|$", "cost $5", "${", "$$", "$1"]
    recipe = [{"GPTQModifier": {**GPTQ, "ignore": ignore}}]
    assert rendered_gptq(render(recipe))["ignore"] == ignore


def test_keys_are_never_substituted():
    assert find_placeholders({"$key": 1}) == set()
    with pytest.raises(RecipeError, match="never keys"):
        substitute({"$key": 1}, {"key": "x"})


# ---------------------------------------------------------------- errors


def test_malformed_yaml_names_line_and_column():
    text = """\
q_stage:
  q_modifiers:
    GPTQModifier:
      ignore: [lm_head
      scheme: W4A16
"""
    with pytest.raises(RecipeError, match=r"at line 5, column 13: .* from line 4, column 15"):
        render(text)


def test_malformed_yaml_file_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("a: [1, 2\nb: c\n")
    with pytest.raises(RecipeError) as err:
        render(str(path))
    assert str(path) in str(err.value) and "line 2, column 2" in str(err.value)


def test_nonexistent_file_is_named(tmp_path):
    missing = str(tmp_path / "nope" / "recipe.yaml")
    with pytest.raises(RecipeError) as err:
        render(missing)
    assert missing in str(err.value) and "does not exist" in str(err.value)


@pytest.mark.parametrize("kind", ["folder", "device", "fifo"])
def test_a_recipe_path_that_is_no_regular_file_says_what_it_is(tmp_path, kind):
    path = tmp_path / "r.yaml"
    if kind == "folder":
        path.mkdir()
    elif kind == "device":
        path.symlink_to("/dev/zero")
    else:
        os.mkfifo(path)  # opening it would block this test for ever
    with pytest.raises(RecipeError) as err:
        render(str(path))
    said = {"folder": "a folder", "device": "a device", "fifo": "a FIFO (named pipe)"}[kind]
    assert f"is not a regular file but {said}" in err.value.problem
    assert "does not exist" not in err.value.problem and "name a .yaml file" in err.value.fix


def test_unknown_preset_suggests_the_nearest():
    with pytest.raises(RecipeError) as err:
        render("W4A61")
    assert "did you mean W4A16" in str(err.value)


def test_unknown_modifier_suggests_the_nearest():
    with pytest.raises(RecipeError) as err:
        render([{"GPTQModifer": GPTQ}])
    assert "GPTQModifer" in err.value.problem and "did you mean GPTQModifier" in err.value.fix


def test_unknown_scheme_is_refused_with_the_preset_schemes():
    with pytest.raises(RecipeError) as err:
        render([{"GPTQModifier": {**GPTQ, "scheme": "W4A17"}}])
    assert "scheme" in err.value.problem and "W4A17" in err.value.problem
    assert "did you mean W4A16" in err.value.fix


def test_misspelt_modifier_field_names_modifier_field_and_fix():
    with pytest.raises(RecipeError) as err:
        render([{"GPTQModifier": {**GPTQ, "dampening_fracc": 0.1}}])
    assert "GPTQModifier in default_stage.default_modifiers" in err.value.problem
    assert "dampening_fracc" in err.value.problem and "did you mean dampening_frac" in err.value.fix


def test_wrong_value_type_names_the_field():
    with pytest.raises(RecipeError, match="dampening_frac"):
        render([{"GPTQModifier": {**GPTQ, "dampening_frac": "$d"}}], recipe_args={"d": "high"})


@pytest.mark.parametrize(
    "args, shown",
    [
        ({"dampening_frac": "-0.5"}, "is '-0.5', outside (0.0, 1.0]"),
        ({"dampening_frac": "inf"}, "is 'inf', outside (0.0, 1.0]"),
        ({"block_size": "0"}, "is '0', outside [1, 1048576]"),
    ],
)
def test_a_number_written_as_a_string_is_range_checked_as_the_number_it_becomes(args, shown):
    """llm-compressor's pydantic coerces "-0.5" to -0.5: the range check must see it too."""
    with pytest.raises(RecipeError) as err:
        render("W4A16", recipe_args=args)
    assert err.value.field == "recipe.recipe_args" and shown in err.value.problem
    assert rendered_gptq(render("W4A16", recipe_args={"dampening_frac": "0.02"}))


@pytest.mark.parametrize("name", ["1", "null", "1.5"])
def test_a_modifier_name_that_is_not_a_string_is_refused_as_unknown(name):
    with pytest.raises(RecipeError, match="unknown modifier") as err:
        render(f"quant_stage:\n  quant_modifiers:\n    {name}: {{}}\n")
    assert "llm-compressor 0.14's modifiers: " in err.value.fix


def test_a_kv_cache_scheme_compressed_tensors_cannot_build_is_refused():
    with pytest.raises(RecipeError, match="num_bits"):
        render("W4A16", recipe_args={"kv_cache_scheme": {"num_bits": 99, "type": "float"}})


def int_weights(bits) -> dict:
    group = {
        "targets": ["Linear"],
        "weights": {"num_bits": bits, "type": "int", "strategy": "channel"},
    }
    return {"GPTQModifier": {"ignore": ["lm_head"], "config_groups": {"group_0": group}}}


@pytest.mark.parametrize("bits", [0, -3, 1, 9, 1000])
def test_an_integer_width_compressed_tensors_cannot_take_is_refused_before_calibration(bits):
    # llm-compressor's parser takes any int, and nothing else looked before calibration.
    with pytest.raises(RecipeError) as err:
        render([int_weights(bits)])
    assert f"asks for {bits}-bit integers in config_groups.group_0.weights, outside 2 to 8" in (
        err.value.problem
    )
    assert err.value.field == "recipe.recipe" and "to 4 (as W4A16) or 8" in err.value.fix
    assert render([int_weights(3)]).modifiers == ["GPTQModifier"]


def test_an_integer_kv_cache_width_is_checked_too():
    kv = {"num_bits": 12, "type": "int", "strategy": "tensor"}
    with pytest.raises(RecipeError, match="12-bit integers in kv_cache_scheme"):
        render("W4A16", recipe_args={"kv_cache_scheme": kv})


def group_weights(group_size) -> dict:
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": group_size}
    group = {"targets": ["Linear"], "weights": weights}
    return {"GPTQModifier": {"ignore": ["lm_head"], "config_groups": {"group_0": group}}}


@pytest.mark.parametrize("written", ["1e400", "'128'", "128 MB", "[128]", "{size: 128}", "true"])
def test_a_group_size_that_is_not_a_number_is_refused_naming_where_it_is(written):
    # compressed-tensors compared it before converting it: "'<' not supported between
    # instances of 'str' and 'int'", naming no field; `true` was taken as a group of one.
    recipe = yaml.safe_dump([group_weights(0)]).replace("group_size: 0", f"group_size: {written}")
    with pytest.raises(RecipeError) as err:
        render(recipe)
    assert "GPTQModifier.config_groups.group_0.weights.group_size in default_stage" in (
        err.value.problem
    )
    assert "not a whole number" in err.value.problem and "e.g. 128" in err.value.fix
    assert render([group_weights(128)]).modifiers == ["GPTQModifier"]


def test_a_modifier_with_both_a_scheme_and_config_groups_is_refused_at_render():
    both = int_weights(4)
    both["GPTQModifier"]["scheme"] = "W4A16"
    with pytest.raises(RecipeError) as err:
        render([both])
    assert "either `scheme` or `config_groups`" in err.value.problem
    assert "keep one of `scheme` and `config_groups`" in err.value.fix


def test_recipe_level_check_is_reported():
    with pytest.raises(RecipeError, match="AWQ"):
        render([{"AWQModifier": {}}])


@pytest.mark.parametrize(
    "recipe",
    [
        {"stage": {"modifiers": {"GPTQModifier": GPTQ}}},  # llm-compressor would skip it silently
        {"quant_stage": {"quant_modifier": {"GPTQModifier": GPTQ}}},
        {"quant_stage": {"quant_modifiers": {"GPTQModifier": None}}},
        {},
        [],
        "- GPTQModifier\n",  # a list item without arguments
    ],
)
def test_recipes_that_would_lose_modifiers_are_refused(recipe):
    with pytest.raises(RecipeError):
        render(recipe)


# ---------------------------------------------------------------- recipe.kv_cache on your own recipe

FP8_RTN = {"targets": "Linear", "scheme": "FP8_DYNAMIC", "ignore": ["lm_head"]}


def test_kv_cache_fp8_goes_to_each_quantizing_modifier_of_your_own_recipe():
    # Your own recipe, as a list and with the `kv_cache_scheme: null` a published recipe.yaml holds.
    recipe = [
        {"SmoothQuantModifier": {"smoothing_strength": 0.8}},
        {"GPTQModifier": {**GPTQ, "kv_cache_scheme": None}},
        {"QuantizationModifier": {**FP8_RTN, "ignore": ["lm_head", "re:.*down_proj"]}},
    ]
    result = render(recipe, kv_cache="fp8")
    (stage,) = yaml.safe_load(result.yaml).values()
    (group,) = stage.values()
    assert "kv_cache_scheme" not in group["SmoothQuantModifier"]
    assert group["GPTQModifier"]["kv_cache_scheme"] == KV_CACHE_FP8
    assert group["QuantizationModifier"]["kv_cache_scheme"] == KV_CACHE_FP8
    assert result.kv_cache_scheme == KV_CACHE_FP8 and result.needs_data
    assert result.sha256 != render(recipe).sha256  # so the run key changes with it


def test_kv_cache_fp8_refuses_your_own_recipe_without_a_quantizing_modifier():
    with pytest.raises(RecipeError) as raised:
        render([{"SmoothQuantModifier": {"smoothing_strength": 0.8}}], kv_cache="fp8")
    assert raised.value.field == "recipe.kv_cache"
    assert "no modifier of recipe.recipe quantizes" in raised.value.problem
    assert "QuantizationModifier" in raised.value.fix and "off" in raised.value.fix


def test_kv_cache_fp8_refuses_your_own_recipe_asking_for_another_kv_cache():
    int8 = {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}
    recipe = [{"QuantizationModifier": {**FP8_RTN, "kv_cache_scheme": int8}}]
    with pytest.raises(RecipeError) as raised:
        render(recipe, kv_cache="fp8")
    assert raised.value.field == "recipe.kv_cache"
    where = "recipe.recipe (QuantizationModifier in default_stage.default_modifiers)"
    assert where in raised.value.problem and where in raised.value.fix
    assert "'type': 'int'" in raised.value.problem
    assert render(recipe).kv_cache_scheme["type"] == "int"  # off: the recipe's own is kept


# ---------------------------------------------------------------- pipeline


@pytest.mark.parametrize(
    "recipe, asked, effective",
    [
        ("W4A16", None, "sequential"),
        ("W4A16", "independent", "sequential"),
        ("W4A16", "basic", "basic"),
        ("FP8_DYNAMIC", "sequential", "datafree"),
        ("FP8_DYNAMIC", "basic", "basic"),
    ],
)
def test_effective_pipeline(recipe, asked, effective):
    assert render(recipe, pipeline=asked).pipeline == effective


def test_datafree_pipeline_for_a_data_recipe_is_kept_with_a_note():
    result = render("W4A16", pipeline="datafree")
    assert result.pipeline == "datafree" and any("datafree" in n for n in result.notes)


# ---------------------------------------------------------------- properties

IDENTIFIERS = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True)
JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(alphabet=string.printable, max_size=20)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=100, deadline=None)
@given(name=IDENTIFIERS, value=JSON_VALUES, braced=st.booleans())
def test_a_whole_placeholder_gives_back_exactly_the_value(name, value, braced):
    placeholder = f"${{{name}}}" if braced else f"${name}"
    parsed = yaml.safe_load(f"key: {placeholder}\n")  # as written in a YAML recipe
    rendered = substitute(parsed, {name: value})
    assert rendered == {"key": value}
    # ... and survives the canonical YAML round trip that oneshot reads.
    assert yaml.safe_load(yaml.safe_dump(rendered, sort_keys=False)) == {"key": value}


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_any_mix_renders_exactly_or_names_every_missing_and_unused_name(data):
    used = data.draw(st.lists(IDENTIFIERS, max_size=5, unique=True), label="placeholders")
    # Drawn close to `used` so that both the exact and the failing branches are common.
    kept = data.draw(st.sets(st.sampled_from(used)) | st.just(set(used))) if used else set()
    extra = data.draw(st.just({}) | st.dictionaries(IDENTIFIERS, JSON_SCALARS, max_size=3))
    given_args = {**{n: data.draw(JSON_SCALARS) for n in sorted(kept)}, **extra}
    recipe = {
        "whole": [f"${n}" for n in used],
        "embedded": [f"<{{${{{n}}}}}>" for n in used],  # "<{${name}}>": the outer braces stay
        "regex": "re:.*lm_head$",
    }
    missing, unused = set(used) - set(given_args), set(given_args) - set(used)
    if not missing and not unused:
        assert substitute(recipe, given_args) == {
            "whole": [given_args[n] for n in used],
            "embedded": [f"<{{{given_args[n]}}}>" for n in used],
            "regex": "re:.*lm_head$",
        }
        return
    with pytest.raises(RecipeError) as err:
        substitute(recipe, given_args)
    message = str(err.value)
    assert all(mentions(message, f"${n}") for n in missing)
    assert all(mentions(message, n) for n in unused)
