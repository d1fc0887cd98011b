"""Benchmark: what serving a compressed yardstick buys, measured as evaluate-model measures it.

Each preset's output of the learned-weights yardstick (`compressflow.demo.yardstick`, compressed
by the compress-model flow from a bf16 copy: the 16-bit base) is served by `vllm serve` beside
that base with the same flags and measured by `vllm bench serve`
(compressflow/evaluation/served.py): output throughput, time to first token and inter-token
latency (p50, p95) at each concurrency level, medians over interleaved repeats with their spread,
the verdict, the kernel vLLM names, and what the measurement costs in seconds. The whole
measurement runs `--runs` times, so the table shows how repeatable it is twice over: the spread
across repeats inside a run, and the medians across runs. The 1-minute load average is printed
before and after each measurement: on a 2-core host the load generator shares the cores with
both servers, and anything else running distorts every figure.

    python -m benchmarks.served_speed [--presets W8A8,FP8_DYNAMIC,W4A16,MIX4.5] [--runs 2] [--workdir DIR]
        [--input-len 64] [--output-len 32] [--concurrency 1,4] [--prompts 8] [--repeats 3]
        [--timeout-minutes 30] [--yardstick DIR]
        [--outputs W8A8=DIR,... --base DIR --held-out FILE]   # measure folders made before

No target: the figures are reported as measured. Exits 1 when a measurement fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.quality_table import bf16_copy, environment

CALIBRATION_TEXTS = 256  # as the yardstick's matrix tests
HELD_OUT_TEXTS = 256
MIX = "MIX"  # --presets MIX4.5: W4A16 mixed to 4.5 bits a weight


def load() -> str:
    return f"{os.getloadavg()[0]:.2f}"


def compress_preset(yardstick, base: Path, preset: str, out: Path) -> Path:
    """The preset's output of `base`; `MIX<bits>` (e.g. MIX4.5): W4A16 mixed to that budget of
    bits per weight (int4, int8 and 16-bit modules; target.avg_bits)."""
    from compressflow.flows.compress import compress
    from compressflow.params import (
        DatasetArgs,
        HeldOutArgs,
        ModelArgs,
        OutputArgs,
        RecipeArgs,
        TargetArgs,
        TrackingArgs,
        VerifyArgs,
    )

    target = TargetArgs()
    if preset.startswith(MIX):
        target = TargetArgs(
            avg_bits=float(preset.removeprefix(MIX)),
            held_out=HeldOutArgs(
                dataset_name=str(yardstick.held_out),
                samples=128,
                max_seq_len=yardstick.spec.seq_len,
            ),
        )
        preset = "W4A16"
    if not (out / "manifest.json").exists():
        compress(
            model=ModelArgs(model_id=str(base)),
            dataset=DatasetArgs(
                dataset_name=str(yardstick.calibration),
                text_samples=CALIBRATION_TEXTS,
                max_seq_len=yardstick.spec.seq_len,
            ),
            recipe=RecipeArgs(preset=preset),
            target=target,
            output=OutputArgs(save_directory=str(out), auto_evaluate=False),
            tracking=TrackingArgs(enabled=False),
            verify=VerifyArgs(vllm="off", min_cosine=1e-9, max_kl=1e9, min_top1=1e-9),
        )
    return out


def prompts_for(base: Path, held_out_file: Path, served) -> list[str]:
    """Prompts as evaluate-model cuts them, from the held-out file's texts (base's tokenizer)."""
    import json

    from transformers import AutoTokenizer

    from compressflow.data.result import HeldOutText
    from compressflow.evaluation.served import held_out_prompts

    tokenizer = AutoTokenizer.from_pretrained(base)
    lines = held_out_file.read_text().splitlines()[:HELD_OUT_TEXTS]
    held_out = HeldOutText(
        source=str(held_out_file),
        input_ids=[tokenizer(json.loads(line)["text"]).input_ids for line in lines],
        excluded_calibration_samples=0,
    )
    return held_out_prompts(held_out, base, served)


def rows(preset: str, run: int, found, before: str, after: str) -> list[str]:
    """Markdown rows, one per level: base and compressed throughput (median, range), ratio,
    verdict, TTFT and ITL p50 medians, kernels, seconds, load average."""
    if found.status != "measured":
        return [f"| {preset} | {run} | {found.status}: {found.reason} |"]
    lines = []
    for level in found.levels:
        b, c = level.base, level.compressed

        def span(f) -> str:
            return f"{f.median:.1f} ({f.low:.1f}-{f.high:.1f})"

        lines.append(
            f"| {preset} | {run} | {level.concurrency} | {span(b['output_throughput'])} | "
            f"{span(c['output_throughput'])} | {level.throughput_ratio:.2f} | {level.verdict} | "
            f"{b['ttft_p50'].median:.1f} / {c['ttft_p50'].median:.1f} | "
            f"{b['itl_p50'].median:.2f} / {c['itl_p50'].median:.2f} | "
            f"{b['itl_p95'].median:.2f} / {c['itl_p95'].median:.2f} | "
            f"{found.seconds:.0f} | {before} / {after} |"
        )
    return lines


HEADER = (
    "| preset | run | concurrency | base tokens/s (range) | compressed tokens/s (range) | "
    "ratio | verdict | TTFT p50 ms base / compressed | ITL p50 ms | ITL p95 ms | seconds | "
    "load before / after |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="W8A8,FP8_DYNAMIC")
    parser.add_argument("--runs", type=int, default=2, help="whole measurements per preset")
    parser.add_argument("--workdir", default="", help="keeps the outputs")
    parser.add_argument("--yardstick", default="", help="a built yardstick's root to reuse")
    parser.add_argument(
        "--outputs", default="", help="NAME=DIR,...: measure these folders, nothing compressed"
    )
    parser.add_argument("--base", default="", help="with --outputs: their 16-bit base")
    parser.add_argument("--held-out", default="", help="with --outputs: a JSONL of texts")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout-minutes", type=float, default=30)
    args = parser.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="served-speed-")).resolve()
    environment(work, "auto")

    from prefect.testing.utilities import prefect_test_harness

    from compressflow.demo.yardstick import build_yardstick
    from compressflow.evaluation.args import ServedArgs
    from compressflow.evaluation.served import serve_and_measure

    served = ServedArgs(
        input_len=args.input_len,
        output_len=args.output_len,
        concurrency=[int(level) for level in args.concurrency.split(",")],
        prompts=args.prompts,
        repeats=args.repeats,
        timeout_minutes=args.timeout_minutes,
    )
    if args.outputs:  # folders made before: measured as they are
        base, held_out_file = Path(args.base), Path(args.held_out)
        outputs = dict(
            (name, Path(folder))
            for name, _, folder in (item.partition("=") for item in args.outputs.split(","))
        )
    else:
        yardstick = build_yardstick(Path(args.yardstick) if args.yardstick else work / "yardstick")
        base, held_out_file = (
            bf16_copy(yardstick.model, work / "yardstick-bf16"),
            yardstick.held_out,
        )
        presets = [name.strip() for name in args.presets.split(",")]
        with prefect_test_harness(server_startup_timeout=120):
            outputs = {
                p: compress_preset(yardstick, base, p, work / "outputs" / p) for p in presets
            }
    prompts = prompts_for(base, held_out_file, served)
    print(f"workload: {served.model_dump(exclude={'measure'})}", flush=True)
    lines, kernels, failed = [], {}, False
    for run in range(1, args.runs + 1):
        for preset, output in outputs.items():
            before, started = load(), time.perf_counter()
            found = serve_and_measure(base, output, prompts, served)
            after = load()
            print(
                f"  {preset} run {run}: {found.status} in {time.perf_counter() - started:.0f} s "
                f"(load {before} / {after}) {found.reason}",
                flush=True,
            )
            failed |= found.status == "failed"
            lines += rows(preset, run, found, before, after)
            if found.status == "measured":
                kernels[preset] = found.kernels
                device, backend, flags = found.device, found.backend, found.serve_flags
    print()
    if kernels:
        print(f"device: {device}; backend: {backend}; flags: {' '.join(flags)}")
        for preset, named in kernels.items():
            print(
                f"kernels, {preset}: base {named.get('base')}; compressed {named.get('compressed')}"
            )
    print()
    print(HEADER)
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
