"""The Prefect artifacts a person reads after a run: their keys and how their figures read.

Everything here is built from small constructed results: no model loads and no Prefect run.
"""

from __future__ import annotations

import re

import pytest
from support.reports import evaluation_report

from compressflow.flows.evaluate import evaluation_key
from compressflow.flows.sweep import ranking_rows
from compressflow.params import METRICS, ModelArgs, QualityGate
from compressflow.reporting.artifacts import (
    MAX_KEY_LENGTH,
    artifact_key,
    duration,
    layer_error_table,
    location_markdown,
    slug,
    stage_table,
)
from compressflow.reporting.evaluation import metric_rows
from compressflow.reporting.summary import summary_key, summary_markdown
from compressflow.results import (
    ModuleMetric,
    Point,
    PointResult,
    PublishedModel,
    StageRecord,
    Verification,
    VerificationCheck,
)
from compressflow.store.manifest import Manifest, ManifestResult
from compressflow.tasks.verify import verification_markdown

KEY = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
SHA = "0123456789abcdef0123456789abcdef01234567"
VERIFIED = Verification(
    passed=True,
    checks=[VerificationCheck(name="logits", passed=True, detail="ok")],
    cosine=0.998765432,
    kl_divergence=0.0123456789,
    top1_agreement=0.987654,
)


def manifest(model_id: str = "meta-llama/Llama-3.2-1B-Instruct", **changes) -> Manifest:
    fields = dict(
        created_at="2026-01-02T03:04:05+00:00",
        result=ManifestResult(
            run_key="k" * 64,
            model_identity=f"hub:{model_id}@{SHA}",
            scheme="W4A16",
            size_bytes=1_000_000,
            original_size_bytes=4_000_000,
            compression_ratio=4.0,
        ),
        inputs={},
        model={
            "model_id": model_id,
            "source": "hub",
            "revision_resolved": SHA,
            "identity": f"hub:{model_id}@{SHA}",
        },
        dataset=None,
        recipe={"source": "preset:W4A16"},
        libraries={},
        stages=[],
        peak_rss_mb=1.0,
        verification=VERIFIED,
    )
    return Manifest(**{**fields, **changes})


def published(made: Manifest, reused: bool = False) -> PublishedModel:
    return PublishedModel(path="/out/llama-w4a16", reused=reused, **made.result.model_dump())


STAGES = [
    StageRecord(name="fetch model", seconds=0.0342, cached=True),
    StageRecord(name="calibrate", seconds=12.345, cached=False),
    StageRecord(name="publish", seconds=0.5, cached=False),
]


# keys


def test_keys_name_the_model_and_the_recipe():
    key = artifact_key("meta-llama/Llama-3.2-1B-Instruct", "preset:W4A16", "summary")
    assert key == "llama-3-2-1b-instruct-w4a16-summary"
    assert artifact_key("/models/my_model/", "yaml", "summary") == "my-model-custom-summary"


def test_two_models_get_two_summary_keys():
    first = summary_key(manifest("meta-llama/Llama-3.2-1B-Instruct"))
    second = summary_key(manifest("Qwen/Qwen2.5-0.5B"))
    assert first != second
    assert first == summary_key(manifest("meta-llama/Llama-3.2-1B-Instruct")), "deterministic"


@pytest.mark.parametrize(
    "model_id, source",
    [
        ("meta-llama/Llama-3.2-1B-Instruct", "preset:W4A16"),
        ("  Ünïcode__Model!!  ", "file:/r.yaml"),
        ("a" * 300, "preset:FP8_DYNAMIC"),
        ("___", None),
    ],
)
def test_every_key_is_one_prefect_accepts(model_id, source):
    for kind in ("summary", "verification", "evaluation", "sweep"):
        key = artifact_key(model_id, source, kind)
        assert KEY.match(key) and len(key) <= MAX_KEY_LENGTH and key.endswith(f"-{kind}"), key


def test_long_names_stay_distinct_when_cut():
    first, second = slug("x" * 200 + "one"), slug("x" * 200 + "two")
    assert len(first) == len(second) == MAX_KEY_LENGTH and first != second
    assert slug("--A  b..C--") == "a-b-c"


def test_evaluation_key_matches_the_recipe_in_the_manifest():
    base = ModelArgs(model_id="meta-llama/Llama-3.2-1B-Instruct")
    assert evaluation_key(base, manifest()) == "llama-3-2-1b-instruct-w4a16-evaluation"
    assert evaluation_key(base, None) == "llama-3-2-1b-instruct-custom-evaluation"


# summary


def test_summary_shows_the_base_model_id_and_its_revision():
    text = summary_markdown(published(manifest()), manifest(), STAGES, None)
    assert "**Base model**: `meta-llama/Llama-3.2-1B-Instruct` (hub, revision `" + SHA in text
    assert "# Compressed model: Llama-3.2-1B-Instruct W4A16" in text


def test_summary_shows_paths_as_code_and_only_web_links_as_links():
    text = summary_markdown(published(manifest()), manifest(), STAGES, "/tmp/clearml/offline-1")
    assert "file://" not in text and "](" not in text
    assert "- **Output**: `/out/llama-w4a16`" in text
    assert "- **ClearML**: `/tmp/clearml/offline-1`" in text
    online = summary_markdown(published(manifest()), manifest(), STAGES, "https://app/x/y")
    assert "- **ClearML**: [task page](https://app/x/y)" in online
    assert location_markdown("file:///a", "a") == "`file:///a`"


def test_summary_stage_table_ends_with_a_total():
    text = summary_markdown(published(manifest()), manifest(), STAGES, None)
    assert "| fetch model | 34 ms | yes |" in text
    assert "| calibrate | 12.3 s | no |" in text
    assert "| publish | 500 ms | no |" in text
    assert "| **total** | **12.9 s** | |" in text
    assert stage_table([]).endswith("| **total** | **0 ms** | |")


def test_reused_summary_says_when_it_was_published():
    made = manifest()
    text = summary_markdown(published(made, reused=True), made, STAGES[:1], None)
    assert "**Reused**" in text and made.created_at in text
    assert "**Reused**" not in summary_markdown(published(made), made, STAGES, None)


def test_summary_rounds_the_verification_figures():
    text = summary_markdown(published(manifest()), manifest(), STAGES, None)
    assert "cosine 0.9988, KL 0.01235 nats/token, top-1 agreement 98.8 %" in text


# per-module errors


def test_layer_errors_worst_first_with_unit_and_cap():
    modules = [
        ModuleMetric(name=f"layers.{i}.mlp", error=float(i) + 0.123456, seconds=0.061)
        for i in range(60)
    ]
    modules.append(ModuleMetric(name="layers.x.nan", error=float("nan")))
    modules.append(ModuleMetric(name="layers.x.none"))
    table = layer_error_table(modules, limit=50)
    rows = [line for line in table.splitlines() if line.startswith("| layers.")]
    assert len(rows) == 50
    assert rows[0].startswith("| layers.x.nan | nan |"), "a NaN loss is the worst"
    assert rows[1] == "| layers.59.mlp | 59.12 | 0.061 |"
    errors = [float(row.split("|")[2]) for row in rows[1:]]
    assert errors == sorted(errors, reverse=True)
    assert "quantization error (GPTQ loss, output squared error)" in table
    assert "time (s)" in table
    assert "12 more module(s)" in table and "Worst 50 of 62" in table


def test_summary_includes_the_layer_errors():
    made = manifest(modules=[ModuleMetric(name="layers.0.q_proj", error=12345.678)])
    text = summary_markdown(published(made), made, STAGES, None)
    assert "| layers.0.q_proj | 12350 |" in text and "left out" not in text


# figures


def test_durations():
    assert duration(0.0004) == "0 ms"
    assert duration(0.9994) == "999 ms"
    assert duration(1.0) == "1.0 s"
    assert duration(754.36) == "754.4 s"


def test_evaluation_rows_are_rounded_with_units():
    rows = {r["metric"]: r for r in metric_rows(evaluation_report(), QualityGate())}
    perplexity = rows["perplexity"]
    assert (perplexity["base"], perplexity["compressed"]) == (12.35, 13.46)
    assert perplexity["change"] == "+9.0 %"
    assert perplexity["limit"] == "max increase: 10.0 %"
    kl = rows["KL(base || compressed), nats/token"]
    assert kl["compressed"] == 0.01235 and kl["limit"] == "max: 0.1 nats/token"
    assert rows["top-1 agreement"]["compressed"] == "93.5 %"


def test_evaluation_rows_without_limits_and_with_lm_eval():
    scores = evaluation_report(
        base={"hellaswag/acc": 0.45678912}, compressed={"hellaswag/acc": 0.4412345}
    )
    scores.lm_eval_backend, scores.lm_eval_recovery = "hf", {"hellaswag/acc": 96.5964}
    gate = QualityGate(max_perplexity_increase_pct=0, max_kl=0, min_lm_eval_recovery_pct=95)
    rows = {r["metric"]: r for r in metric_rows(scores, gate)}
    assert rows["perplexity"]["limit"] == "none"
    row = rows["lm-eval hellaswag/acc (hf)"]
    assert (row["base"], row["compressed"]) == (0.4568, 0.4412)
    assert (row["change"], row["limit"]) == ("recovery 96.6%", "min recovery: 95%")


def test_verification_artifact_rounds_its_figures():
    text = verification_markdown(VERIFIED, "/out/m", "Llama-3.2-1B-Instruct W4A16")
    assert text.startswith("# Verification of Llama-3.2-1B-Instruct W4A16: passed")
    assert "cosine 0.9988, KL 0.01235 nats/token, top-1 agreement 98.8 %" in text


def test_verification_states_held_out_perplexity_recovery_from_its_logits():
    verified = VERIFIED.model_copy(update={"base_perplexity": 12.0, "compressed_perplexity": 12.5})
    text = verification_markdown(verified, "/out/m", "Llama-3.2-1B-Instruct W4A16")
    assert "held-out perplexity 12 -> 12.5, recovery 96.0% (transformers, verify's logits)" in text


def test_sweep_ranking_is_rounded():
    metrics = {
        "perplexity_increase_pct": 3.14159,
        "kl_divergence": 0.0123456,
        "top1_agreement": 0.95432,
        "compressed_perplexity": 12.34567,
    }
    assert set(metrics) == set(METRICS)
    done = PointResult(
        point=Point(recipe_args={"dampening_frac": 0.01}, text_samples=16),
        status="completed",
        metrics=metrics,
        objective=metrics["kl_divergence"],
    )
    failed = PointResult(point=Point(recipe_args={}, text_samples=16), status="failed", error="x")
    best, worst = ranking_rows([done, failed], "kl_divergence")
    assert best["objective"] == best["kl_divergence"] == 0.01235
    assert best["perplexity_increase_pct"] == "+3.1 %"
    assert best["top1_agreement"] == "95.4 %"
    assert best["compressed_perplexity"] == 12.35
    assert worst["objective"] is None and worst["kl_divergence"] is None
