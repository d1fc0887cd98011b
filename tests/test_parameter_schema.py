"""The deployments' parameter schema: the UI form's limits, enforced by the server before any run.

Every deployment in prefect.yaml enforces its schema, and every preset's parameters fit it. With
enforcement on, the Prefect server refuses (409) a run whose parameters break the schema, so a bad
value typed into the UI's form or passed to `prefect deployment run` never starts a flow run.

What the schema cannot catch: `recipe.recipe` is free-form (preset name, YAML, path, dict or list),
so an unknown preset name passes the schema; the flow's first stage (render recipe, before any
download) refuses it, naming the nearest preset.
"""

from __future__ import annotations

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
    definitions = schema_of("flows/compress.py:compress")["definitions"]
    assert definitions["DatasetArgs"]["properties"]["text_samples"]["minimum"] == 0
    pipeline = definitions["RecipeArgs"]["properties"]["pipeline"]
    assert "sequential" in next(choice["enum"] for choice in pipeline["anyOf"] if "enum" in choice)
    assert definitions["DatasetArgs"]["additionalProperties"] is False
    calibration = definitions["CalibrationArgs"]["properties"]
    assert calibration["path"]["enum"] == ["auto", "classic", "model_free"]
    assert calibration["max_cpu_memory_gb"]["minimum"] == 0
    assert calibration["sequential_prefetch"]["enum"] == ["auto", "on", "off"]
    # Every knob explains itself in the form, with no text the UI would strip as HTML.
    assert all(
        field["description"] and "<" not in field["description"] for field in calibration.values()
    )
    gate = schema_of("flows/evaluate.py:evaluate")["definitions"]["QualityGate"]["properties"]
    assert gate["on_threshold"]["enum"] == ["fail", "flag"]


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


def test_unknown_preset_passes_the_schema_and_fails_in_the_first_stage():
    from compressflow.errors import RecipeError
    from compressflow.params import RecipeArgs
    from compressflow.tasks.render_recipe import render_recipe

    schema = schema_of("flows/compress.py:compress")
    validate(with_required(schema, {"recipe": {"recipe": "W4A17"}}), schema, raise_on_error=True)
    with pytest.raises(RecipeError, match="did you mean W4A16"):
        render_recipe.fn(RecipeArgs(recipe="W4A17"))
