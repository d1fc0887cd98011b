"""Calibration progress: the real calibrate path on the tiny model advances once per subgraph.

The tiny Llama has 2 decoder layers, so the sequential pipeline runs 3 subgraphs (the leading
embeddings subgraph, then one per layer). The Prefect progress artifact must end at 100, and the
log lines and the ClearML figures must advance subgraph by subgraph.
"""

from __future__ import annotations

import asyncio
import logging
import re

import prefect.artifacts
import pytest

from compressflow.flows.compress import compress
from compressflow.params import DatasetArgs, ModelArgs, OutputArgs, RecipeArgs
from compressflow.recipes.render import render
from compressflow.reporting import progress, tracking

pytestmark = pytest.mark.usefixtures("prefect_harness")


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_progress_advances_per_subgraph_and_reaches_100(tiny_model, tmp_path, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    updates: list[float] = []
    # compressflow.reporting.progress imports it at each call, so patching the module attribute reaches it.
    original = prefect.artifacts.update_progress_artifact

    def spy(artifact_id, progress, description=None, **kwargs):
        updates.append(progress)
        return original(artifact_id, progress, description, **kwargs)

    monkeypatch.setattr(prefect.artifacts, "update_progress_artifact", spy)
    figures: list[tuple[str, float, int]] = []
    real_scalar = tracking.Tracker.scalar

    def record_scalar(self, title, series, value, iteration=0):
        if title == progress.CLEARML_TITLE:
            figures.append((series, value, iteration))
        return real_scalar(self, title, series, value, iteration)

    monkeypatch.setattr(tracking.Tracker, "scalar", record_scalar)
    lines = _Lines()
    logging.getLogger("prefect.task_runs").addHandler(lines)
    try:
        state = compress(
            model=ModelArgs(model_id=str(tiny_model)),
            dataset=DatasetArgs(text_samples=8, max_seq_len=64, seed=3),
            recipe=RecipeArgs(recipe="W4A16"),
            output=OutputArgs(save_directory=str(tmp_path / "out")),
            return_state=True,
        )
    finally:
        logging.getLogger("prefect.task_runs").removeHandler(lines)
    assert state.is_completed()

    progress_lines = [line for line in lines.lines if line.startswith("Calibration progress")]
    assert [re.search(r"subgraph (\d+)/3 done", line).group(1) for line in progress_lines] == [
        "1",
        "2",
        "3",
    ]
    assert "ETA unknown" in progress_lines[0] and re.search(r"ETA \d+ s", progress_lines[-1])
    # One update per subgraph, then the final one; percents only go up and end at 100.
    assert updates == [33.3, 66.7, 100.0, 100.0]
    done = [
        (value, iteration) for series, value, iteration in figures if series == "subgraphs done"
    ]
    assert done == [(1, 1), (2, 2), (3, 3)]

    async def read_artifacts():
        async with get_client() as client:
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(
                    flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])
                )
            )

    artifacts = [a for a in asyncio.run(read_artifacts()) if a.type == "progress"]
    assert len(artifacts) == 1 and artifacts[0].data == 100.0
    assert "Calibrated 3 subgraph(s)" in artifacts[0].description


def test_two_data_modifiers_make_two_passes():
    w8a8 = """
quant_stage:
  quant_modifiers:
    SmoothQuantModifier: {smoothing_strength: 0.8}
    GPTQModifier: {targets: Linear, scheme: W8A8, ignore: [lm_head]}
"""
    rendered = render(RecipeArgs(recipe=w8a8))
    assert rendered.data_modifiers == 2
    assert progress.sequential_passes(rendered.data_modifiers, None) == 2
    assert progress.sequential_passes(rendered.data_modifiers, "sequential") == 1
    assert progress.sequential_passes(rendered.data_modifiers, "basic") == 0


def test_every_algorithm_reports_seconds_per_layer_not_only_gptq(tiny_model, tmp_path):
    """Static FP8 activations (QuantizationModifier: no GPTQ loss lines) still time each layer."""
    import json
    from pathlib import Path

    static_fp8 = "- QuantizationModifier: {targets: Linear, scheme: FP8, ignore: [lm_head]}\n"
    published = compress(
        model=ModelArgs(model_id=str(tiny_model)),
        dataset=DatasetArgs(text_samples=8, max_seq_len=64, seed=5),
        recipe=RecipeArgs(recipe=static_fp8),
        output=OutputArgs(save_directory=str(tmp_path / "static")),
    )
    manifest = json.loads(Path(published.path, "manifest.json").read_text())
    assert manifest["modules"] == [], "no GPTQ: no per-module loss"
    layers = manifest["layers"]
    assert [(layer["calibration_pass"], layer["layer"]) for layer in layers] == [
        (1, 0),
        (1, 1),
        (1, 2),
    ]
    assert all(layer["seconds"] > 0 for layer in layers)
