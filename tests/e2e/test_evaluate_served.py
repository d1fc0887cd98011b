"""evaluate-model's served performance where the worker has no vLLM environment
(COMPRESSFLOW_VLLM_PYTHON=off, as conftest sets for every test): asked for, it is "not measured
here" with the reason, in the report, the card, the manifest, both Prefect artifacts and ClearML,
and gate.min_speedup flags the run instead of failing it. And the measured figures' ClearML
scalars and bar plot, reported in a real offline session.

Real Prefect (the test harness), the session's shared W4A16 output, ClearML offline; no vLLM
starts, so it costs one evaluation of the tiny model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from compressflow.params import HeldOutArgs, ModelArgs, QualityGate, ServedArgs
from compressflow.reporting.artifacts import artifact_key
from compressflow.store.manifest import read_manifest

pytestmark = pytest.mark.usefixtures("prefect_harness")

TESTS = Path(__file__).resolve().parents[1]


def test_served_performance_without_vllm_is_not_measured_here_and_only_flags(w4a16_run, tiny_model):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from compressflow.flows.evaluate import evaluate

    assert os.environ["COMPRESSFLOW_VLLM_PYTHON"] == "off"
    compressed = w4a16_run.published.path
    state = evaluate(
        compressed=ModelArgs(model_id=compressed),
        held_out=HeldOutArgs(samples=4, max_seq_len=64),
        served=ServedArgs(concurrency=[1, 2], prompts=4, repeats=1),
        gate=QualityGate(min_speedup=1.2),  # asked for, and not judgeable here
        return_state=True,
    )
    report = state.result()
    reason = "no vLLM environment (COMPRESSFLOW_VLLM_PYTHON is off)"
    assert report.served.status == "not measured here" and report.served.reason == reason
    assert report.passed and report.breaches == []
    assert report.flags == [
        f"gate.min_speedup 1.2 not judged: served performance not measured here: {reason}"
    ]

    # The card and the manifest of the folder it evaluated.
    card = Path(compressed, "README.md").read_text()
    assert f"## Performance\n\nServed speed and memory: not measured here: {reason}." in card
    assert "(flagged: gate.min_speedup 1.2 not judged" in card
    assert read_manifest(Path(compressed)).evaluation.served.status == "not measured here"

    # Both artifacts of the run: the table's row and the performance artifact.
    with get_client(sync_client=True) as client:
        artifacts = {
            a.key: a
            for a in client.read_artifacts(
                artifact_filter=ArtifactFilter(
                    flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])
                )
            )
        }
    table = artifacts[artifact_key(str(tiny_model), "preset:W4A16", "evaluation")]
    rows = {row["metric"]: row for row in json.loads(table.data)}
    assert rows["served performance (vLLM)"]["compressed"] == f"not measured here: {reason}"
    assert rows["gate: not judged (a warning)"]["limit"] == report.flags[0]
    assert "FLAGGED: gate.min_speedup 1.2" in table.description
    chart = artifacts[artifact_key(str(tiny_model), "preset:W4A16", "performance")]
    assert f"not measured here: {reason}" in chart.data and chart.data.startswith("# Performance")

    # ClearML offline: the reason, in the session's log.
    session = Path(report.tracking.split(": ", 1)[1].split(";")[0])
    assert f"Served performance not measured here: {reason}" in (session / "log.jsonl").read_text()


def test_measured_figures_reach_clearml_offline_as_scalars_and_a_bar_plot(tmp_path):
    """Recorded figures through the real SDK, offline, in a process of its own (one ClearML
    task per process): every call is one FIELD_NOTES lists as working offline, the bar plot
    (report_histogram) included, and none fails."""
    script = f"""
import json, sys
sys.path.insert(0, {str(TESTS)!r})
from support.reports import served_performance
from compressflow.reporting.performance import log_performance
from compressflow.reporting.tracking import open_run
with open_run("p", "served", []) as tracker:
    log_performance(tracker, served_performance())
    link = tracker.link()
print(json.dumps([link, tracker.failures]))
"""
    env = {**os.environ, "HOME": str(tmp_path), "CLEARML_OFFLINE_MODE": "1"}
    env.pop("CLEARML_CONFIG_FILE", None)
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr
    link, failures = json.loads(run.stdout.splitlines()[-1])
    assert failures == []
    events = [
        event
        for line in (Path(link) / "metrics.jsonl").read_text().splitlines()
        for event in json.loads(line)
    ]
    scalars = {
        (e["metric"], e["variant"], e["iter"]): e["value"]
        for e in events
        if e["type"] == "training_stats_scalar"
    }
    assert scalars[("served output throughput (tokens/s)", "compressed", 4)] == 90.2
    assert ("served time to first token p95 (ms)", "base", 1) in scalars
    plots = [json.loads(e["plot_str"]) for e in events if e["type"] == "plot"]
    bars = [trace for plot in plots for trace in plot["data"] if trace.get("type") == "bar"]
    assert [trace["name"] for trace in bars] == ["base", "compressed"]
    assert list(bars[1]["y"]) == [55.3, 90.2]
