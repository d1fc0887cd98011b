"""The deployments' parameter schema, enforced by a server: with enforcement on, the Prefect
server refuses (409) a run whose parameters break the schema, so a bad value typed into the UI's
form or passed to `prefect deployment run` never starts a flow run. The schema and the form
themselves: tests/unit/test_parameter_schema.py.
"""

from __future__ import annotations

import pytest
from prefect.flows import load_flow_from_entrypoint
from support.schema import DEPLOYMENTS, with_required


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
