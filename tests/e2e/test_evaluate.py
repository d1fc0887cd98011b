"""evaluate-model on the tiny model: real Prefect, real compressed checkpoint, ClearML offline.

The session's one shared W4A16 compression (conftest's `w4a16_run`) is what they evaluate. The held-out text must not contain the calibration
samples, metrics must be finite and logged to Prefect and ClearML, and the quality gate must fail
or flag the run as asked.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from compressflow.errors import InputError, ModelFetchError, QualityThresholdExceeded
from compressflow.evaluation.harness import NEXT_LINE_TASK, OWN_TASKS, PERPLEXITY_TASK
from compressflow.flows.evaluate import evaluate
from compressflow.params import (
    DatasetArgs,
    HeldOutArgs,
    LmEvalArgs,
    ModelArgs,
    QualityGate,
    ServedArgs,
)
from compressflow.reporting.artifacts import artifact_key
from compressflow.store.manifest import read_manifest
from compressflow.tasks.build_held_out import build_held_out
from compressflow.tasks.fetch_model import fetch

pytestmark = pytest.mark.usefixtures("prefect_harness")

CALIBRATION = DatasetArgs(dataset_name="python_docs", text_samples=16, max_seq_len=64)
FEW = HeldOutArgs(samples=8, max_seq_len=128)
# Served speed is test_evaluate_served.py's: these tests do not pay for it.
UNSERVED = ServedArgs(measure=False)


@pytest.fixture(scope="module")
def compressed(w4a16_run) -> str:
    """The session's shared W4A16 run (calibrated on CALIBRATION's data)."""
    assert w4a16_run.params["dataset"] == CALIBRATION
    return w4a16_run.published.path


def test_metrics_of_a_compressed_model_against_the_base_in_its_manifest(compressed, tiny_model):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )

    report = evaluate(
        compressed=ModelArgs(model_id=compressed), held_out=FEW, served=UNSERVED, return_state=True
    )
    flow_run_id = report.state_details.flow_run_id
    report = report.result()
    m = report.metrics
    assert report.passed and not report.breaches and report.scheme == "W4A16"
    assert report.base_identity == fetch(ModelArgs(model_id=str(tiny_model))).identity
    assert math.isfinite(m.base_perplexity) and math.isfinite(m.compressed_perplexity)
    assert m.kl_divergence > 0 and 0 < m.top1_agreement <= 1
    assert m.samples == FEW.samples and m.tokens > FEW.samples
    assert report.excluded_calibration_samples == CALIBRATION.text_samples

    with get_client(sync_client=True) as client:
        (table,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]),
                key=ArtifactFilterKey(
                    any_=[artifact_key(str(tiny_model), "preset:W4A16", "evaluation")]
                ),
            )
        )
    rows = {row["metric"]: row for row in json.loads(table.data)}
    assert rows["perplexity"]["compressed"] == pytest.approx(m.compressed_perplexity, abs=0.005)

    # The card of the folder it evaluated gained the results (front matter kept, no temp file).
    from huggingface_hub import ModelCard

    card = ModelCard.load(Path(compressed, "README.md"))
    assert card.text.count("## Evaluation") == 1 and "scored by transformers" in card.text
    assert f"{m.compressed_perplexity:.4g}" in card.text and "W4A16" in card.data.tags
    assert not list(Path(compressed).glob(".*.tmp"))

    # ClearML offline session: the metrics were reported as single values.
    session = Path(report.tracking.split(": ", 1)[1].split(";")[0])
    reported = (session / "metrics.jsonl").read_text()
    assert "kl_divergence" in reported and "perplexity" in reported


def test_held_out_text_leaves_out_the_calibration_samples(compressed, tiny_model):
    from datasets import load_from_disk

    from compressflow.data.build import build
    from compressflow.settings import cache_root

    base = fetch(ModelArgs(model_id=str(tiny_model)))
    calibration = read_manifest(Path(compressed)).calibration_args()
    assert calibration == CALIBRATION
    # Same source, seed and length as calibration: without the exclusion it would draw the very
    # same rows.
    same_draw = HeldOutArgs(samples=16, max_seq_len=64, seed=CALIBRATION.seed).dataset_args()
    held_out = build_held_out(same_draw, base, calibration)
    built = build(CALIBRATION, base, cache_root() / "datasets")
    calibrated = load_from_disk(built.path)["input_ids"]
    assert held_out.excluded_calibration_samples == 16
    assert len(held_out.input_ids) == 16
    assert not {tuple(ids) for ids in held_out.input_ids} & {tuple(ids) for ids in calibrated}


def test_a_manifest_never_asks_to_run_its_base_models_code(compressed, tmp_path):
    # An output shared on the hub carries its manifest: one that names, as its base, a model
    # with code of its own (here, its own folder) must not get that code run by an evaluation.
    shared = tmp_path / "downloaded"
    shutil.copytree(compressed, shared)
    manifest = json.loads((shared / "manifest.json").read_text())
    manifest["inputs"]["model"].update(model_id=str(shared), trust_remote_code=True)
    (shared / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InputError) as raised:
        evaluate(compressed=ModelArgs(model_id=str(shared)), held_out=FEW, served=UNSERVED)
    assert str(raised.value) == (
        f"base: the manifest of {shared} names its base model {shared} with trust_remote_code: "
        "true, and evaluate-model runs no code a file it reads asks for. Fix: pass base.model_id "
        "yourself, with base.trust_remote_code: true if you trust that model's code"
    )


def test_gate_fails_the_run_when_a_threshold_is_passed(compressed):
    gate = QualityGate(max_kl=1e-9, on_threshold="fail")
    with pytest.raises(QualityThresholdExceeded, match="KL divergence"):
        evaluate(
            compressed=ModelArgs(model_id=compressed), held_out=FEW, gate=gate, served=UNSERVED
        )


def test_gate_flags_the_run_when_asked_to(compressed):
    # KL, not perplexity: quantizing a random-weight model can lower its perplexity by chance.
    gate = QualityGate(max_perplexity_increase_pct=0, max_kl=1e-9, on_threshold="flag")  # 0: off
    report = evaluate(
        compressed=ModelArgs(model_id=compressed), held_out=FEW, gate=gate, served=UNSERVED
    )
    assert not report.passed
    assert report.breaches and report.breaches[0].startswith("KL divergence")


def test_a_perplexity_rise_past_the_limit_is_a_breach():
    from compressflow.evaluation.quality import breaches
    from compressflow.results import QualityMetrics

    metrics = QualityMetrics.model_construct(
        perplexity_increase_pct=2.5, compressed_perplexity=41.0, kl_divergence=None
    )
    assert breaches(metrics, 2.0, 0.1) == ["perplexity rose 2.50% (limit 2.0%)"]
    assert breaches(metrics, 3.0, 0.1) == []


def test_missing_compressed_model_fails_before_loading():
    with pytest.raises(ModelFetchError, match="does not exist"):
        evaluate(compressed=ModelArgs(model_id="/nowhere/model"))


def test_lm_eval_runs_our_offline_tasks_on_both_models_and_the_gate_holds_their_recovery(
    compressed,
):
    # No held_out_file: our tasks are built from the held-out texts the evaluation scores.
    tasks = LmEvalArgs(tasks=list(OWN_TASKS), limit=8)
    gate = QualityGate(min_lm_eval_recovery_pct=1000, on_threshold="flag")  # none can pass

    report = evaluate(
        compressed=ModelArgs(model_id=compressed),
        held_out=FEW,
        lm_eval=tasks,
        gate=gate,
        served=UNSERVED,
    )

    assert report.lm_eval_backend == "hf"
    named = {f"{NEXT_LINE_TASK}/acc", f"{PERPLEXITY_TASK}/word_perplexity"}
    assert named <= set(report.lm_eval["base"]) == set(report.lm_eval["compressed"])
    assert set(report.lm_eval_recovery) == set(report.lm_eval["compressed"])
    assert all(math.isfinite(pct) and pct > 0 for pct in report.lm_eval_recovery.values())
    assert not report.passed and len(report.breaches) == len(report.lm_eval_recovery)
    assert read_manifest(Path(compressed)).evaluation.lm_eval == report.lm_eval
    card = Path(compressed, "README.md").read_text()
    pct = report.lm_eval_recovery[f"{NEXT_LINE_TASK}/acc"]
    assert f"| lm-eval {NEXT_LINE_TASK}/acc (hf) |" in card and f"| {pct:.1f}% |" in card
    # And verify's own recovery figure, there whether or not vLLM served the output.
    verified = next(line for line in card.splitlines() if line.startswith("- **Verified**"))
    assert "held-out perplexity" in verified and "(transformers, verify's logits)" in verified
    session = Path(report.tracking.split(": ", 1)[1].split(";")[0])
    assert "lm-eval recovery %" in (session / "metrics.jsonl").read_text()
