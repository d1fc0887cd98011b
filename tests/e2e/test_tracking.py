"""ClearML tracking, asserted on the offline session the real SDK writes.

No ClearML server runs here, so offline mode is the real code path: the tests read the session
folder (task.json, metrics.jsonl, artifacts) that a later `Task.import_offline_session` uploads.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pydantic import SecretStr

from compressflow.blocks.clearml_settings import ClearMLSettings
from compressflow.flows.compress import compress
from compressflow.params import (
    DatasetArgs,
    ModelArgs,
    OutputArgs,
    RecipeArgs,
    TrackingArgs,
)

pytestmark = pytest.mark.usefixtures("prefect_harness")

ACCESS_KEY = "ACCESSKEY-5f1d2c3b-do-not-leak"
SECRET_KEY = "SECRETKEY-9a8b7c6d-do-not-leak"
HUB_TOKEN = "hf_TOKEN3e4f5a6b-do-not-leak"


def run(tiny_model, target: Path, model: ModelArgs | None = None, **tracking):
    return compress(
        model=model or ModelArgs(model_id=str(tiny_model)),
        dataset=DatasetArgs(dataset_name="python_docs", text_samples=16, max_seq_len=64),
        recipe=RecipeArgs(recipe="W4A16", recipe_args={"dampening_frac": 0.02}),
        output=OutputArgs(save_directory=str(target), tags=["nightly", "w4a16"]),
        tracking=TrackingArgs(**tracking),
    )


def offline_session(published) -> Path:
    mode, _, folder = published.tracking.partition(": ")
    assert mode == "offline", published.tracking
    return Path(folder.split(";")[0])


def hyperparams(session: Path) -> dict[str, dict[str, str]]:
    task = json.loads((session / "task.json").read_text())
    return {
        section: {name: item["value"] for name, item in values.items()}
        for section, values in task["hyperparams"].items()
    }


def test_one_offline_task_holds_every_stage(w4a16_run):
    published = w4a16_run.published
    session = offline_session(published)
    task = json.loads((session / "task.json").read_text())
    assert task["name"] == "tracking test"
    assert {"nightly", "w4a16"} <= set(task["tags"])
    assert any(tag.startswith("prefect-flow-run:") for tag in task["tags"])
    assert "Prefect flow run" in task["comment"]

    params = hyperparams(session)
    assert params["model"]["identity"].startswith("sha256:")
    assert int(params["model"]["parameters"]) > 0
    assert params["dataset"]["source"] == "shortcut:python_docs"
    assert int(params["dataset"]["samples"]) == 16
    assert params["recipe_args"]["dampening_frac"] == "0.02"
    assert params["traceability"]["subgraphs"] == "3"
    assert params["dataset args"]["text_samples"] == "16"
    assert "GPTQModifier" in task["configuration"]["recipe"]["value"]
    assert params["verification"]["passed"] == "True"
    assert "no missing or unexpected keys" in params["verification"]["reload"]

    # Each line is one batch of reported events.
    lines = (session / "metrics.jsonl").read_text().splitlines()
    metrics = [event for line in lines for event in json.loads(line)]
    errors = [m for m in metrics if m.get("metric") == "quantization error by layer"]
    assert {m["variant"] for m in errors} >= {"q_proj", "down_proj"}
    assert {m["iter"] for m in errors} == {0, 1}, "one point per layer"
    cosine = [m for m in metrics if m.get("variant") == "verification cosine"]
    assert cosine and cosine[0]["value"] > 0.9

    artifacts = {a["key"] for a in task["execution"]["artifacts"]}
    assert {"manifest", "recipe", "compressed-model"} <= artifacts


def test_a_run_started_by_a_tracked_process_gets_its_own_task(w4a16_run, monkeypatch):
    # What a worker's flow run inherits when the worker was started from a tracked process:
    # ClearML would otherwise hand this run a stub and log nothing. (A rerun of the shared run's
    # parameters: the reuse path opens and logs its task as a calibration does.)
    monkeypatch.setenv("CLEARML_PROC_MASTER_ID", "1:0123456789abcdef")
    published = compress(**w4a16_run.params)
    assert "FAILED" not in published.tracking
    assert hyperparams(offline_session(published))["model"]["identity"].startswith("sha256:")


def test_cache_hits_still_log_their_stage(w4a16_run):
    second = compress(**w4a16_run.params)
    assert second.reused
    params = hyperparams(offline_session(second))
    assert params["model"]["identity"].startswith("sha256:")
    assert params["dataset"]["fingerprint"]
    assert params["recipe_args"]["dampening_frac"] == "0.02"
    task = json.loads((offline_session(second) / "task.json").read_text())
    assert "GPTQModifier" in task["configuration"]["recipe"]["value"]


def all_text_under(folder: Path) -> str:
    return "\n".join(p.read_bytes().decode("latin-1") for p in folder.rglob("*") if p.is_file())


@pytest.fixture()
def silent_server():
    """A port that accepts connections and never answers: the worst kind of outage."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted = []
    stop = threading.Event()

    def accept():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in accepted:
        conn.close()
    listener.close()


def test_unreachable_server_still_publishes_in_bounded_time_without_leaking_keys(
    tiny_model, hub_cache, tmp_path, silent_server, monkeypatch, capfd
):
    from prefect.blocks.system import Secret

    monkeypatch.delenv("CLEARML_OFFLINE_MODE")
    monkeypatch.setenv("HF_TOKEN", HUB_TOKEN)
    Secret(value=HUB_TOKEN).save("hub-token", overwrite=True)
    ClearMLSettings(
        api_host=silent_server,
        web_host=silent_server,
        files_host=silent_server,
        access_key=SecretStr(ACCESS_KEY),
        secret_key=SecretStr(SECRET_KEY),
        connect_timeout_seconds=2,
    ).save("unreachable-clearml", overwrite=True)

    started = time.perf_counter()
    hub_model = ModelArgs(model_id="acme/tiny-llama", hub_token_block="hub-token")
    published = run(tiny_model, tmp_path / "out", hub_model, clearml_block="unreachable-clearml")
    assert time.perf_counter() - started < 120
    assert "unreachable" in published.tracking and "logged offline instead" in published.tracking
    assert Path(published.path, "manifest.json").exists()

    session = offline_session(published)
    printed = capfd.readouterr()
    for text in (
        printed.out + printed.err,
        all_text_under(session),
        all_text_under(Path(published.path)),
        published.model_dump_json(),
    ):
        for secret in (ACCESS_KEY, SECRET_KEY, HUB_TOKEN):
            assert secret not in text


def test_tables_are_logged_without_pandas_in_the_flows_process(tmp_path):
    """clearml imports pandas and pyarrow only for what compressflow does not use; the flow's
    process leaves them out (issue 23) and a table still reaches the session, NaN spelled out.
    Numbered parameters (a recipe's notes) are logged too, not tracking's end."""
    script = """
import json, sys
from compressflow.reporting.tracking import open_run
with open_run("p", "table", []) as tracker:
    tracker.params("recipe_notes", {0: "first note", 1: "second"})
    tracker.table("t", [{"a": 1.5, "b": float("nan")}, {"a": 2, "c": "x"}])
    link = tracker.link()
print(json.dumps([link, tracker.failures, "pandas" in sys.modules,
                  "pyarrow" in sys.modules]))
"""
    env = {**os.environ, "HOME": str(tmp_path), "CLEARML_OFFLINE_MODE": "1"}
    env.pop("CLEARML_CONFIG_FILE", None)
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr
    link, failures, pandas, pyarrow = json.loads(run.stdout.splitlines()[-1])
    assert (failures, pandas, pyarrow) == ([], False, False)
    assert hyperparams(Path(link))["recipe_notes"] == {"0": "first note", "1": "second"}
    lines = (Path(link) / "metrics.jsonl").read_text().splitlines()
    plots = [
        json.loads(e["plot_str"]) for line in lines for e in json.loads(line) if e["metric"] == "t"
    ]
    table = plots[0]["data"][0]
    assert table["header"]["values"] == ["a", "b", "c"]
    assert table["cells"]["values"] == [[1.5, 2], ["NaN", ""], ["", "x"]]
