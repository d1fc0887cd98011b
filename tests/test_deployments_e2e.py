"""prefect.yaml end to end, the way a user runs it: a real server, a process pool, a worker.

One module-scoped set-up does what the README's "Deployments" section tells a user to do, against
a `prefect server` on 127.0.0.1 with its own PREFECT_HOME: create the `gpu` process pool, register
the blocks, `prefect --no-prompt deploy --all`, start a worker with `--limit 1`. The test then
runs the compress deployment on the tiny model and waits for the evaluate deployment, started by
the `compressflow.model.published` event, to complete with its metrics. Every process started here
runs in its own process group and is stopped in the fixture's teardown, whatever happened.
"""

from __future__ import annotations

import json
import math
import time

import pytest
from prefect_stack import Stack, wait_final


@pytest.fixture(scope="module")
def stack(prefect_stack):
    return prefect_stack


@pytest.fixture
def client(stack_client):
    return stack_client


def wait_triggered_run(client, stack: Stack, deployment_id, timeout: float):
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
        )
        if runs:
            return wait_final(client, stack, runs[0].id, max(deadline - time.monotonic(), 1))
        time.sleep(1)
    pytest.fail("the published event did not start evaluate-model\n" + stack.tail("server"))


def test_prefect_yaml_deploys_presets_limits_and_blocks(stack, client):
    nightly = client.read_deployment_by_name("compress-model/nightly-w4a16")
    assert [s.active for s in nightly.schedules] == [False], "the nightly must ship inactive"
    assert nightly.parameters["recipe"]["recipe"] == "W4A16"
    for name in (
        "compress-model/compress",
        "compress-model/w8a8",
        "compress-model/fp8-dynamic",
        "evaluate-model/evaluate",
    ):
        deployment = client.read_deployment_by_name(name)
        assert deployment.work_pool_name == "gpu"
        assert deployment.global_concurrency_limit.limit == 1
        env = deployment.job_variables["env"]
        # Resolved from the OutputSettings block that `python -m compressflow.blocks.register` saved.
        assert env["COMPRESSFLOW_OUTPUT_DIR"] == str(stack.logs / "outputs")
        assert env["CUDA_VISIBLE_DEVICES"] == "0"


def test_deployment_rejects_bad_parameters_before_any_run(stack, client, tiny_model):
    from prefect.exceptions import PrefectHTTPStatusError

    deployment = client.read_deployment_by_name("compress-model/compress")
    assert deployment.enforce_parameter_schema
    bad = {"model": {"model_id": str(tiny_model)}, "dataset": {"text_samples": -1}}
    runs_before = len(client.read_flow_runs())
    with pytest.raises(PrefectHTTPStatusError) as refused:
        client.create_flow_run_from_deployment(deployment.id, parameters=bad)
    assert refused.value.response.status_code in (409, 422)
    assert "text_samples" in refused.value.response.text
    assert len(client.read_flow_runs()) == runs_before, "a run was created for bad parameters"


def test_compress_deployment_publishes_and_triggers_evaluation(stack, client, tiny_model, tmp_path):
    started = time.monotonic()
    compress_deployment = client.read_deployment_by_name("compress-model/compress")
    evaluate_deployment = client.read_deployment_by_name("evaluate-model/evaluate")
    target = tmp_path / "tiny-w4a16"
    parameters = {
        "model": {"model_id": str(tiny_model)},
        "dataset": {"dataset_name": "python_docs", "text_samples": 16, "max_seq_len": 64},
        "recipe": {"recipe": "W4A16"},
        "output": {"save_directory": str(target), "tags": ["e2e"]},
    }
    run = client.create_flow_run_from_deployment(compress_deployment.id, parameters=parameters)
    run = wait_final(client, stack, run.id, timeout=180)
    assert run.state.is_completed(), f"compress-model ended {run.state}\n" + stack.tail("worker")
    assert (target / "manifest.json").exists()

    evaluation = wait_triggered_run(client, stack, evaluate_deployment.id, timeout=180)
    assert evaluation.state.is_completed(), (
        f"evaluate-model ended {evaluation.state}\n" + stack.tail("worker")
    )
    # Filled in by the trigger from the event's payload.
    assert evaluation.parameters["compressed"] == {"model_id": str(target)}
    assert evaluation.parameters["base"]["model_id"] == str(tiny_model)

    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )

    artifacts = client.read_artifacts(
        artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[evaluation.id]),
            key=ArtifactFilterKey(any_=["evaluation-metrics"]),
        )
    )
    assert len(artifacts) == 1
    rows = {row["metric"]: row for row in json.loads(artifacts[0].data)}
    perplexity = rows["perplexity"]
    assert math.isfinite(perplexity["base"]) and math.isfinite(perplexity["compressed"])
    assert rows["KL(base || compressed), nats/token"]["compressed"] >= 0
    print(f"compress -> evaluate through the deployments: {time.monotonic() - started:.1f} s")
