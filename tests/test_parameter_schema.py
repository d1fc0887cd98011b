"""The deployments' parameter schema: the UI form's limits, enforced by the server before any run.

Every deployment in prefect.yaml enforces its schema, and every preset's parameters fit it. With
enforcement on, the Prefect server refuses (409) a run whose parameters break the schema, so a bad
value typed into the UI's form or passed to `prefect deployment run` never starts a flow run.

The form itself: `recipe.preset` is a dropdown of the presets; a recipe of one's own goes in the
free-form `recipe.recipe` (YAML or a path), which the schema cannot check: the flow's first stage
(render recipe, before any download) refuses a bad one. No field of a form is
`X | None` (the UI would show a type toggle and "Property is type None"), and every description
survives the UI's markdown rendering with no text lost (an `<model>` would vanish as an HTML tag).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from prefect.flows import load_flow_from_entrypoint
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools import validate

ROOT = Path(__file__).resolve().parents[1]
DEPLOYMENTS = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]


def schema_of(entrypoint: str) -> dict:
    return parameter_schema(load_flow_from_entrypoint(entrypoint)).model_dump_for_openapi()


def with_required(schema: dict, parameters: dict) -> dict:
    """`parameters` plus a placeholder model for required ones the run or trigger supplies."""
    missing = {name: {"model_id": "org/model"} for name in schema.get("required", [])}
    return {**missing, **parameters}


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


def visible_text(markdown: str) -> str:
    """What the UI shows of a description: its markdown rendered, HTML tags dropped."""
    from markdown_it import MarkdownIt

    html = MarkdownIt().render(markdown)
    text = re.sub(r"<[^>]*>", "", html)
    for entity, char in (("&lt;", "<"), ("&gt;", ">"), ("&quot;", '"'), ("&#39;", "'")):
        text = text.replace(entity, char)
    return " ".join(text.replace("&amp;", "&").split())


def plain_text(markdown: str) -> str:
    """The description's words, markdown markup removed: what must survive rendering."""
    text = re.sub(r"^- ", "", markdown, flags=re.M).replace("**", "").replace("`", "")
    return " ".join(text.split())


@pytest.mark.parametrize("entrypoint", sorted({d["entrypoint"] for d in DEPLOYMENTS}))
def test_every_description_renders_without_lost_text(entrypoint):
    fields = [(name, field.get("description", "")) for name, field in fields_of(entrypoint)]
    assert [name for name, description in fields if not description] == []
    for name, description in fields:
        assert visible_text(description) == plain_text(description), name


@pytest.fixture(scope="module")
def deployment_ids(prefect_harness):
    """The compress and evaluate flows deployed, schema enforced, to the session's test server."""
    ids = {}
    for spec in DEPLOYMENTS:
        name = spec["entrypoint"].rsplit(":", 1)[1]
        if name not in ids:
            flow = load_flow_from_entrypoint(spec["entrypoint"])
            deployment = flow.to_deployment(name=f"schema-{name}", enforce_parameter_schema=True)
            ids[name] = deployment.apply()
    return ids


BAD = [
    ("compress", {"dataset": {"text_samples": -1}}, "text_samples"),
    ("compress", {"recipe": {"pipeline": "layer_sequential"}}, "layer_sequential"),
    ("compress", {"dataset": {"txt_samples": 16}}, "txt_samples"),
    ("compress", {"model": {"model_id": ""}}, "model_id"),
    ("compress", {"calibration": {"path": "fastest"}}, "fastest"),
    ("compress", {"calibration": {"batch_size": -1}}, "batch_size"),
    ("compress", {"recipe": {"preset": "W4A17"}}, "W4A17"),
    ("compress", {"output": {"tags": ["nightly", "line one\nline two"]}}, "line one"),
    ("compress", {"output": {"tags": ["t" * 101]}}, "tttt"),
    ("evaluate", {"gate": {"on_threshold": "warn"}}, "warn"),
    ("evaluate", {"held_out": {"samples": 0}}, "samples"),
]


@pytest.mark.parametrize("flow_name, bad, named", BAD, ids=[b[2] for b in BAD])
def test_server_refuses_a_run_with_bad_parameters(deployment_ids, flow_name, bad, named):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.exceptions import PrefectHTTPStatusError

    deployment_id = deployment_ids[flow_name]
    only_this = DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
    with get_client(sync_client=True) as client:
        schema = client.read_deployment(deployment_id).parameter_openapi_schema
        with pytest.raises(PrefectHTTPStatusError) as refused:
            client.create_flow_run_from_deployment(
                deployment_id, parameters=with_required(schema, bad)
            )
        assert refused.value.response.status_code == 409
        assert named in refused.value.response.json()["detail"]
        assert not client.read_flow_runs(deployment_filter=only_this)


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
