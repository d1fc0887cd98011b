"""The deployments' parameter schema: the UI form's limits, enforced by the server before any run.

Every deployment in prefect.yaml enforces its schema, and every preset's parameters fit it. With
enforcement on, the Prefect server refuses (409) a run whose parameters break the schema, so a bad
value typed into the UI's form or passed to `prefect deployment run` never starts a flow run
(tests/e2e/test_parameter_schema_server.py).

The form itself: `recipe.preset` is a dropdown of the presets; a recipe of one's own goes in the
free-form `recipe.recipe` (YAML or a path), which the schema cannot check: the flow's first stage
(render recipe, before any download) refuses a bad one. No field of a form is
`X | None` (the UI would show a type toggle and "Property is type None"), and every description
survives the UI's markdown rendering with no text lost (an `<model>` would vanish as an HTML tag).
"""

from __future__ import annotations

import pytest
from prefect.flows import load_flow_from_entrypoint
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools import validate
from support.schema import DEPLOYMENTS, plain_text, visible_text, with_required


def schema_of(entrypoint: str) -> dict:
    return parameter_schema(load_flow_from_entrypoint(entrypoint)).model_dump_for_openapi()


@pytest.mark.parametrize("spec", DEPLOYMENTS, ids=[d["name"] for d in DEPLOYMENTS])
def test_each_deployment_enforces_its_schema_and_its_parameters_fit(spec):
    assert spec["enforce_parameter_schema"] is True
    schema = schema_of(spec["entrypoint"])
    # The server's own check (prefect.utilities.schema_tools.validate), then pydantic's.
    parameters = with_required(schema, spec.get("parameters", {}))
    validate(parameters, schema, raise_on_error=True)
    load_flow_from_entrypoint(spec["entrypoint"]).validate_parameters(parameters)


def test_the_form_shows_limits_and_choices():
    from compressflow.registries.presets import PRESETS

    definitions = schema_of("flows/compress.py:compress")["definitions"]
    assert definitions["DatasetArgs"]["properties"]["text_samples"]["minimum"] == 0
    recipe = definitions["RecipeArgs"]["properties"]
    assert recipe["preset"]["enum"] == list(PRESETS)
    assert recipe["preset"]["default"] == "W4A16"
    assert recipe["recipe"]["type"] == "string", "one text field: no str/dict/list toggle"
    assert "sequential" in recipe["pipeline"]["enum"]
    assert definitions["DatasetArgs"]["additionalProperties"] is False
    calibration = definitions["CalibrationArgs"]["properties"]
    assert calibration["path"]["enum"] == ["auto", "classic", "model_free"]
    assert calibration["max_cpu_memory_gb"]["minimum"] == 0
    assert calibration["max_gpu_memory_gb"]["minimum"] == 0
    assert calibration["sequential_prefetch"]["enum"] == ["auto", "on", "off"]
    gate = schema_of("flows/evaluate.py:evaluate")["definitions"]["QualityGate"]["properties"]
    assert gate["on_threshold"]["enum"] == ["fail", "flag"]


def test_every_preset_shows_its_placeholders_and_defaults_in_the_form():
    from compressflow.registries.presets import PRESETS

    help_text = schema_of("flows/compress.py:compress")["definitions"]["RecipeArgs"]["properties"][
        "preset"
    ]["description"]
    for name, preset in PRESETS.items():
        assert f"**{name}**" in help_text
        for placeholder, default in preset.defaults().items():
            assert f"`{placeholder}`={default!r}" in help_text


def form_fields():
    return [
        (f"{entrypoint.split(':')[1]}.{name}", field)
        for entrypoint in sorted({d["entrypoint"] for d in DEPLOYMENTS})
        for name, field in fields_of(entrypoint)
    ]


def fields_of(entrypoint: str):
    definitions = schema_of(entrypoint)["definitions"]
    return [
        (f"{group}.{name}", field)
        for group, model in definitions.items()
        for name, field in model["properties"].items()
    ]


@pytest.mark.parametrize("name, field", form_fields(), ids=[n for n, _ in form_fields()])
def test_no_field_of_a_form_is_optional_none(name, field):
    assert "anyOf" not in field, f"{name} renders as a type toggle: {field['anyOf']}"


@pytest.mark.parametrize("entrypoint", sorted({d["entrypoint"] for d in DEPLOYMENTS}))
def test_every_description_renders_without_lost_text(entrypoint):
    fields = [(name, field.get("description", "")) for name, field in fields_of(entrypoint)]
    assert [name for name, description in fields if not description] == []
    for name, description in fields:
        assert visible_text(description) == plain_text(description), name


def test_an_unknown_preset_in_the_free_recipe_field_fails_in_the_first_stage():
    from compressflow.errors import RecipeError
    from compressflow.params import RecipeArgs
    from compressflow.tasks.render_recipe import render_recipe

    schema = schema_of("flows/compress.py:compress")
    validate(with_required(schema, {"recipe": {"recipe": "W4A17"}}), schema, raise_on_error=True)
    with pytest.raises(RecipeError, match="did you mean W4A16"):
        render_recipe.fn(RecipeArgs(recipe="W4A17"))


# Token-shaped: what a tired user pastes into a `*_block` field instead of the block's name.
TOKEN = "hf_" + "QzXwVuTsRqPoNmLkJiHgFeDcBa0123456789"[:34]


def test_a_block_name_field_refuses_a_token_in_the_form_and_the_flow_without_showing_it():
    from prefect.exceptions import ParameterTypeError

    schema = schema_of("flows/compress.py:compress")
    for group, name in (("ModelArgs", "hub_token_block"), ("TrackingArgs", "clearml_block")):
        assert schema["definitions"][group]["properties"][name]["pattern"] == "^[a-z0-9-]*$"
    bad = {"model": {"model_id": "org/model", "hub_token_block": TOKEN}}
    assert validate(bad, schema), "the server refuses it before a run exists"
    flow = load_flow_from_entrypoint("flows/compress.py:compress")
    with pytest.raises(ParameterTypeError) as refused:
        flow.validate_parameters(bad)
    assert "looks like a secret value, not a block name" in str(refused.value)
    assert TOKEN[3:9] not in str(refused.value)
    flow.validate_parameters({**bad, "model": {"model_id": "m", "hub_token_block": "hf-token"}})


def test_tags_are_bounded_one_line_each_and_say_so():
    from pydantic import ValidationError

    from compressflow.params import OutputArgs

    assert OutputArgs(tags=["nightly", "llama 3 / w4a16"]).tags == ["nightly", "llama 3 / w4a16"]
    with pytest.raises(ValidationError) as refused:
        OutputArgs(tags=["nightly", "x\nprefect.flow-run: spoofed"])
    assert "output.tags: tag 2, 'x\\nprefect.flow-run: spoofed', holds a newline" in str(
        refused.value
    )
    assert "Fix: write each tag as one line of plain text" in str(refused.value)
    for bad in (["t" * 101], [""], ["t"] * 51):
        with pytest.raises(ValidationError):
            OutputArgs(tags=bad)
