"""Two hosts that share nothing but the store and the Prefect server (issue 56, item 5): a compress
run on one worker uploads its output to an s3:// prefix (a real moto server process), and the
evaluation the published event triggers runs on another worker, which reads both models from the
store.

Both workers belong to the README's `gpu` process pool, each in a folder of its own: its working
directory, PREFECT_HOME (so its persisted results), COMPRESSFLOW_CACHE_DIR, COMPRESSFLOW_OUTPUT_DIR,
HF_HOME and TMPDIR; no path in common. They share the code checkout, as hosts deployed from one
path do (prefect.yaml's pull step). Host A takes the compress run (its own work queue); host B,
the evaluate deployment's queue, starts only once the compress run is over and host A's folder is
gone, so the evaluation can read nothing host A wrote but what is in the store. The base model
is itself a prefix in the store, so the event's `base_model` names no path of host A either.

Written against the upload contract (`output.upload_uri`, the event's `upload_uri`); it needs
the compress side's upload stage. `make matrix` runs it (about 5 minutes here).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
from contextlib import suppress
from pathlib import Path

import pytest
from support.prefect_stack import ROOT, Stack, running_stack, wait_final, wait_polling
from support.s3_server import s3_server  # noqa: F401  (the fixture)

COMPRESS_QUEUE = "host-a"


def start_worker(stack: Stack, name: str, folder: Path, *queue: str) -> subprocess.Popen:
    """A worker of the `gpu` pool whose every folder lies in `folder`."""
    for sub in ("home", "cache", "outputs", "hf"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    # Its own temporary folder, short: the forkserver's socket lives there, and a Unix socket's
    # path holds 108 bytes (compressflow.settings.check_temp_dir).
    temp = Path(tempfile.mkdtemp(prefix=f"cf-{folder.name}-"))
    env = {
        **stack.env,
        "PREFECT_HOME": str(folder / "home"),
        "COMPRESSFLOW_CACHE_DIR": str(folder / "cache"),
        "COMPRESSFLOW_OUTPUT_DIR": str(folder / "outputs"),
        "HF_HOME": str(folder / "hf"),
        "TMPDIR": str(temp),
    }
    env.pop("COMPRESSFLOW_COMPILE_CACHE_DIR", None)  # under the cache folder then
    command = [str(ROOT / ".venv" / "bin" / "prefect"), "worker", "start", "--pool", "gpu"]
    for name_of_queue in queue:
        command += ["--work-queue", name_of_queue]
    log = (stack.logs / f"worker-{name}.log").open("w")
    process = subprocess.Popen(
        command, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    stack.processes.append((process, signal.SIGINT))
    wait_polling(stack, process, "gpu")
    return process


def stop_readme_gpu_worker(stack: Stack) -> None:
    """The README's gpu worker polls every queue of the pool: it would take both runs."""
    for process, stop_with in list(stack.processes):
        if "--pool gpu" in " ".join(map(str, process.args)):
            with suppress(ProcessLookupError):
                os.killpg(process.pid, stop_with)
            process.wait(timeout=30)
            stack.processes.remove((process, stop_with))


def upload_plain(client, bucket: str, prefix: str, folder: Path) -> str:
    """`folder` put under `prefix` as another tool would: no manifest of ours."""
    for file in sorted(folder.rglob("*")):
        if file.is_file():
            key = f"{prefix}/{file.relative_to(folder).as_posix()}"
            client.upload_file(str(file), bucket, key)
    return f"s3://{bucket}/{prefix}"


def test_compress_on_one_host_evaluate_on_another_through_the_store(
    s3_server,  # noqa: F811
    tiny_model,
    tmp_path,
):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    bucket = "cf-two-hosts-" + hashlib.sha256(str(tmp_path).encode()).hexdigest()[:8]
    s3 = s3_server.client()
    s3.create_bucket(Bucket=bucket)
    base_uri = upload_plain(s3, bucket, "base/tiny-llama", tiny_model)
    upload_uri = f"s3://{bucket}/models/tiny-llama-w4a16"
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"

    # The stack's environment holds the moto server's AWS_* (the fixture set them first).
    with (
        running_stack(tmp_path / "stack") as stack,
        temporary_settings({PREFECT_API_URL: stack.api_url}),
        get_client(sync_client=True) as client,
    ):
        stop_readme_gpu_worker(stack)
        worker_a = start_worker(stack, "host-a", host_a, COMPRESS_QUEUE)
        compress = client.read_deployment_by_name("compress-model/compress")
        evaluate = client.read_deployment_by_name("evaluate-model/evaluate")
        run = client.create_flow_run_from_deployment(
            compress.id,
            parameters={
                "model": {"model_id": base_uri},
                "dataset": {"dataset_name": "python_docs", "text_samples": 16, "max_seq_len": 64},
                "recipe": {"preset": "W4A16"},
                # A folder of host A's own: the deployment's env names a common output_dir.
                "output": {
                    "save_directory": str(host_a / "outputs" / "tiny-llama-w4a16"),
                    "upload_uri": upload_uri,
                },
            },
            work_queue_name=COMPRESS_QUEUE,
        )
        run = wait_final(client, stack, run.id, timeout=300)
        assert run.state.is_completed(), f"compress ended {run.state}\n" + stack.tail(
            "worker-host-a"
        )
        listed = s3.list_objects_v2(Bucket=bucket, Prefix="models/tiny-llama-w4a16/")
        assert "models/tiny-llama-w4a16/manifest.json" in {o["Key"] for o in listed["Contents"]}

        # The event started the evaluation: it waits in the queue no worker polls yet. Only
        # then may host A go (its flow-run process sends the event as it exits), with everything
        # it wrote; then host B starts.
        waiting = triggered_run(client, stack, evaluate.id, timeout=180)
        os.killpg(worker_a.pid, signal.SIGINT)
        worker_a.wait(timeout=30)
        shutil.rmtree(host_a)
        start_worker(stack, "host-b", host_b, "default")
        evaluation = wait_final(client, stack, waiting.id, timeout=420)
        assert evaluation.state.is_completed(), f"evaluate ended {evaluation.state}\n" + stack.tail(
            "worker-host-b"
        )
        # The trigger read the store's URI from the event, and the base as compress fetched it.
        assert evaluation.parameters["compressed"]["model_id"] == upload_uri
        assert evaluation.parameters["base"]["model_id"] == base_uri
        assert evaluation.parameters["compressed_by"] == str(run.id)
        log_b = (stack.logs / "worker-host-b.log").read_text()
        assert str(host_a) not in log_b  # nothing of host A's was named, let alone read
        downloads = sorted(p.name for p in (host_b / "cache" / "store-models").iterdir())
        assert len([name for name in downloads if not name.startswith(".")]) == 2  # base, output


def triggered_run(client, stack: Stack, deployment_id, timeout: float):
    """The evaluate run the published event started, as soon as it exists."""
    import time

    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
        )
        if runs:
            return runs[0]
        time.sleep(1)
    pytest.fail("the published event did not start evaluate-model\n" + stack.tail("server"))
