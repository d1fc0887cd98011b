"""The kubernetes work pool from the repository's template, on a real Prefect server.

docs/deployments.md's `prefect work-pool create gpu-k8s --type kubernetes --base-job-template
deploy/kubernetes/base-job-template.json` runs as written, against the session's Prefect server
(its own process, the server's own validation of the template). A deployment with prefect.yaml's
`gpu_kubernetes` job variables and `in_image` pull step, and parameters that upload the output,
gets a flow run, and the kubernetes worker's own code (prefect-kubernetes,
`KubernetesWorkerJobConfiguration.resolve_for_flow_run`, what the worker calls before it creates
the Job) renders the Job manifest that would be sent to the cluster. No cluster runs it here.
The static checks of the image and template (pins, COPY sources): tests/unit/test_worker_image.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess

import pytest
import yaml
from support.prefect_stack import ROOT

TEMPLATE = ROOT / "deploy" / "kubernetes" / "base-job-template.json"
UPLOAD_URI = "s3://compressflow-models/llama-3.2-1b-w4a16"
SECRET_KEY = "never-in-a-manifest-0123456789"  # the worker's own AWS key: must not leak


def doc_command() -> list[str]:
    """The pool-creating line of docs/deployments.md, as a user pastes it."""
    lines = [
        line.strip()
        for line in (ROOT / "docs" / "deployments.md").read_text().splitlines()
        if "work-pool create gpu-k8s --type kubernetes" in line
    ]
    assert lines, "docs/deployments.md no longer shows how to create the kubernetes pool"
    return shlex.split(lines[0], comments=True)


def prefect_yaml_definitions() -> dict:
    return yaml.safe_load((ROOT / "prefect.yaml").read_text())["definitions"]


@pytest.fixture
def api_url(prefect_harness) -> str:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def create_pool(api_url: str, tmp_path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PREFECT_API_URL": api_url,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),  # the user's profile stays untouched
    }
    return subprocess.run(
        doc_command(), cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


async def render(pool_name: str, monkeypatch) -> tuple[dict, dict, list[str]]:
    """Deploys compress onto the pool as prefect.yaml's anchors say, starts a flow run of it,
    and renders the run's Job as the kubernetes worker does. Returns the manifest, the run's
    parameters as the server keeps them, and the server's refusals of two bad requests."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    # The worker's own environment holds a key (as a worker host's might): nothing of it may
    # reach the Job, whose credentials come from the Secret.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    definitions = prefect_yaml_definitions()
    pool_anchor = definitions["work_pools"]["gpu_kubernetes"]
    refusals = []
    async with get_client() as client:
        pool = await client.read_work_pool(pool_name)
        assert pool.type == "kubernetes"
        assert pool.base_job_template == json.loads(TEMPLATE.read_text())  # as the file says
        flow_id = await client.create_flow_from_name("compress-model")
        deployment_id = await client.create_deployment(
            flow_id=flow_id,
            name="compress-k8s",
            entrypoint="flows/compress.py:compress",
            work_pool_name=pool_anchor["name"],
            work_queue_name=pool_anchor["work_queue_name"],
            job_variables=pool_anchor["job_variables"],
            pull_steps=definitions["in_image"],
            parameters={
                "model": {"model_id": "meta-llama/Llama-3.2-1B-Instruct"},
                "recipe": {"preset": "W4A16"},
                "output": {"upload_uri": UPLOAD_URI, "upload_credentials": "models-bucket"},
            },
        )
        # A per-run override, as Custom run > Job variables sends it: two GPUs for this run.
        flow_run = await client.create_flow_run_from_deployment(
            deployment_id, job_variables={"gpus": 2}
        )
        # The server validates job variables against the template's schema: a misspelt variable
        # is refused when deploying, a run without an image when it is created.
        try:
            await client.create_deployment(
                flow_id=flow_id,
                name="misspelt",
                work_pool_name=pool_name,
                job_variables={**pool_anchor["job_variables"], "gpu": 2},
            )
        except PrefectHTTPStatusError as exc:
            refusals.append(exc.response.text)
        imageless = await client.create_deployment(
            flow_id=flow_id, name="imageless", work_pool_name=pool_name, job_variables={"gpus": 1}
        )
        try:
            await client.create_flow_run_from_deployment(imageless)
        except PrefectHTTPStatusError as exc:
            refusals.append(exc.response.text)
        configuration = await KubernetesWorkerJobConfiguration.resolve_for_flow_run(
            flow_run, client=client, work_pool=pool, worker_name="render-check"
        )
        parameters = (await client.read_flow_run(flow_run.id)).parameters
    return configuration.job_manifest, parameters, refusals


def test_the_kubernetes_pool_renders_a_gpu_job_with_no_shared_volume(
    api_url, tmp_path, monkeypatch
):
    created = create_pool(api_url, tmp_path)
    assert created.returncode == 0, created.stdout + created.stderr
    pool_name = doc_command()[doc_command().index("create") + 1]
    manifest, parameters, refusals = asyncio.run(render(pool_name, monkeypatch))

    pod = manifest["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    anchor = prefect_yaml_definitions()["work_pools"]["gpu_kubernetes"]["job_variables"]
    assert container["image"] == anchor["image"]
    assert manifest["metadata"]["namespace"] == anchor["namespace"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2  # the run's override
    # The pool's command: the image's ENTRYPOINT (tini --) runs it in place of the worker CMD.
    assert container["args"][:3] == ["prefect", "flow-run", "execute"]
    # Credentials from the Secret, by reference; none in the manifest itself.
    assert container["envFrom"] == [
        {"secretRef": {"name": "compressflow-credentials", "optional": True}}
    ]
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert env["COMPRESSFLOW_GPU_SLOTS"] == "false"  # the pod's GPUs are its own
    assert env["COMPRESSFLOW_OUTPUT_DIR"] == "/scratch/outputs"
    assert env["PREFECT__FLOW_RUN_ID"]
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN"} & set(env)
    assert SECRET_KEY not in json.dumps(manifest)
    # No shared disk: every volume is the pod's own (emptyDir), gone with it; the output leaves
    # through output.upload_uri, a parameter the run reads from the server, not a mount.
    assert all(set(volume) == {"name", "emptyDir"} for volume in pod["volumes"]), pod["volumes"]
    mounted = {mount["name"] for mount in container["volumeMounts"]}
    assert mounted <= {volume["name"] for volume in pod["volumes"]}
    assert {mount["mountPath"] for mount in container["volumeMounts"]} == {"/scratch", "/dev/shm"}
    assert parameters["output"]["upload_uri"] == UPLOAD_URI
    assert UPLOAD_URI not in json.dumps(manifest)

    misspelt, imageless = refusals
    assert "gpu" in misspelt and "Additional properties" in misspelt, misspelt
    assert "'image' is a required property" in imageless, imageless
