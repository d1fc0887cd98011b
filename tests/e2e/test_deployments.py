"""prefect.yaml end to end, the way a user runs it: a real server, process pools, workers.

The session's stack (tests/support/prefect_stack.py) runs the README's "Deployments" commands as
written there: the server, `prefect config set`, both pools, the blocks, `prefect --no-prompt
deploy --all`, the gpu and cpu workers. The tests then read the deployments, run the compress
deployment on the tiny model and wait for the evaluate deployment, started by the
`compressflow.model.published` event, to complete with its metrics; they check that a deploy
naming a missing block is refused with the fix. `prefect deployment run --watch` showing why a
run failed is tests/matrix/test_deployment_watch.py. Every process started runs in its own
process group and is stopped in the fixture's teardown, whatever happened.
"""

from __future__ import annotations

import json
import math
import time

import pytest
from support.prefect_stack import ROOT, Stack, cli, wait_final

from compressflow.reporting.artifacts import artifact_key


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
    assert nightly.parameters["recipe"]["preset"] == "W4A16"
    for name in (
        "compress-model/compress",
        "compress-model/nightly-w4a16",
        "compress-model/w8a8",
        "compress-model/fp8-dynamic",
        "evaluate-model/evaluate",
    ):
        deployment = client.read_deployment_by_name(name)
        assert deployment.work_pool_name == "gpu"
        # Runs of compress and the hand-run presets spread over the fleet's GPUs; the nightly
        # (one folder) and evaluate (no GPU slot) go one at a time, queued.
        if name in ("compress-model/nightly-w4a16", "evaluate-model/evaluate"):
            assert deployment.global_concurrency_limit.limit == 1
            assert deployment.concurrency_options.collision_strategy == "ENQUEUE"
        else:
            assert deployment.global_concurrency_limit is None, name
        env = deployment.job_variables["env"]
        # Resolved from the OutputSettings block that `python -m compressflow.blocks.register` saved.
        assert env["COMPRESSFLOW_OUTPUT_DIR"] == str(stack.logs / "outputs")
        assert "CUDA_VISIBLE_DEVICES" not in env  # calibration takes a free GPU: its slot
        # No token block by default: the presets run without HF_TOKEN at registration.
        assert "hub_token_block" not in deployment.parameters.get("model", {})
    sweep = client.read_deployment_by_name("sweep-recipe/sweep")
    assert sweep.work_pool_name == "cpu"
    assert sweep.parameters["output_root"] == f"{stack.logs / 'outputs'}/sweeps"
    assert "hub_token_block" not in sweep.parameters["model"]


def test_block_check_is_quiet_when_every_block_exists(stack):
    """The build step `prefect deploy` ran for every deployment above, run by hand."""
    done = cli(stack, ".venv/bin/python", "-m", "compressflow.blocks.check_deployments")
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_block_check_names_each_missing_block_and_its_fix(stack, tmp_path):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from compressflow.blocks.check_deployments import missing_blocks

    prefect_file = tmp_path / "prefect.yaml"
    prefect_file.write_text(
        """
deployments:
  - name: tokened
    parameters:
      model: {model_id: acme/tiny-llama, hub_token_block: hf-token}
      tracking: {clearml_block: absent-clearml}
      output_root: "{{ prefect.blocks.compressflow-output-settings.compressflow.output_dir }}/x"
    work_pool:
      job_variables: {env: {TOKEN: "{{ prefect.blocks.secret.gone }}"}}
"""
    )
    with temporary_settings({PREFECT_API_URL: stack.api_url}):
        problems = missing_blocks(prefect_file)
    assert problems == [
        f"deployment tokened: parameter model.hub_token_block names Secret block 'hf-token', "
        f"which does not exist on {stack.api_url}. Fix: HF_TOKEN=... python -m "
        "compressflow.blocks.register, or remove the parameter",
        f"deployment tokened: parameter tracking.clearml_block names ClearML Settings block "
        f"'absent-clearml', which does not exist on {stack.api_url}. Fix: create a ClearML "
        "Settings block named 'absent-clearml' (UI: Blocks > +), or remove the parameter",
        f"deployment tokened: work_pool.job_variables.env.TOKEN names Secret block 'gone', which "
        f"does not exist on {stack.api_url}. Fix: create a Secret block named 'gone' (UI: Blocks "
        "> +), or remove the reference",
    ]


def test_deploy_refuses_a_deployment_naming_a_missing_block(stack, client, tmp_path):
    """prefect.yaml as shipped but for one preset's token block, deployed as the README says."""
    import yaml

    config = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    for deployment in config["deployments"]:  # renamed: were the check broken, none is replaced
        deployment["name"] = f"refused-{deployment['name']}"
    config["deployments"][1]["parameters"]["model"]["hub_token_block"] = "no-such-token"
    (tmp_path / "prefect.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    for shared in (".venv", "flows"):  # the build step's python and the entrypoints
        (tmp_path / shared).symlink_to(ROOT / shared)

    done = cli(stack, ".venv/bin/prefect", "--no-prompt", "deploy", "--all", cwd=tmp_path)
    output = " ".join((done.stdout + done.stderr).split())  # rich wraps long lines
    assert done.returncode != 0, output
    assert (
        f"deployment refused-nightly-w4a16: parameter model.hub_token_block names Secret block "
        f"'no-such-token', which does not exist on {stack.api_url}. Fix: create a Secret block "
        "named 'no-such-token'" in output
    ), output
    deployed = [d.name for d in client.read_deployments()]
    assert not [name for name in deployed if name.startswith("refused-")], deployed


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
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )

    started = time.monotonic()
    compress_deployment = client.read_deployment_by_name("compress-model/compress")
    evaluate_deployment = client.read_deployment_by_name("evaluate-model/evaluate")
    target = tmp_path / "tiny-w4a16"
    parameters = {
        "model": {"model_id": str(tiny_model)},
        "dataset": {"dataset_name": "python_docs", "text_samples": 16, "max_seq_len": 64},
        "recipe": {"preset": "W4A16"},
        "output": {"save_directory": str(target), "tags": ["e2e"]},
    }
    run = client.create_flow_run_from_deployment(compress_deployment.id, parameters=parameters)
    run = wait_final(client, stack, run.id, timeout=180)
    assert run.state.is_completed(), f"compress-model ended {run.state}\n" + stack.tail(
        "worker-gpu"
    )
    assert (target / "manifest.json").exists()

    evaluation = wait_triggered_run(client, stack, evaluate_deployment.id, timeout=180)
    assert evaluation.state.is_completed(), (
        f"evaluate-model ended {evaluation.state}\n" + stack.tail("worker-gpu")
    )
    # Filled in by the trigger from the event's payload.
    assert evaluation.parameters["compressed"] == {"model_id": str(target)}
    assert evaluation.parameters["base"]["model_id"] == str(tiny_model)
    assert evaluation.parameters["compressed_by"] == str(run.id)

    # Which model a run belongs to, from the Runs page: its name and tags.
    assert run.name == f"{tiny_model.name} W4A16"
    assert {"e2e", "W4A16"} <= set(run.tags)
    assert evaluation.name == f"evaluate {target.name}"
    # The two runs link to each other.
    links = {
        a.key: a.data
        for flow_run in (run, evaluation)
        for a in client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]))
        )
        if a.key
    }
    assert any(
        key.endswith("-compressed-by") and str(run.id) in data for key, data in links.items()
    )
    assert any(
        key.endswith("-evaluated-by") and str(evaluation.id) in data for key, data in links.items()
    )

    artifacts = client.read_artifacts(
        artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[evaluation.id]),
            key=ArtifactFilterKey(
                any_=[artifact_key(str(tiny_model), "preset:W4A16", "evaluation")]
            ),
        )
    )
    assert len(artifacts) == 1
    rows = {row["metric"]: row for row in json.loads(artifacts[0].data)}
    perplexity = rows["perplexity"]
    assert math.isfinite(perplexity["base"]) and math.isfinite(perplexity["compressed"])
    assert rows["KL(base || compressed), nats/token"]["compressed"] >= 0
    # lm-eval's figures, base beside compressed with recovery, arrive in the published card.
    assert rows["lm-eval compressflow_next_line/acc (hf)"]["change"].startswith("recovery ")
    assert "| lm-eval compressflow_next_line/acc (hf) |" in (target / "README.md").read_text()
    print(f"compress -> evaluate through the deployments: {time.monotonic() - started:.1f} s")


def test_the_deployed_form_has_the_preset_dropdown_and_whole_help(client):
    """What the UI renders: the schema the server holds for the deployment, not the flow's."""
    from support.schema import plain_text, visible_text

    from compressflow.registries.presets import PRESETS

    schema = client.read_deployment_by_name("compress-model/compress").parameter_openapi_schema
    definitions = schema["definitions"]
    assert definitions["RecipeArgs"]["properties"]["preset"]["enum"] == list(PRESETS)
    for group, model in definitions.items():
        for name, field in model["properties"].items():
            assert "anyOf" not in field, f"{group}.{name} renders as a type toggle"
            description = field["description"]
            assert visible_text(description) == plain_text(description), f"{group}.{name}"
