"""Benchmark: what calibration checkpoints (compressflow.calibration.resume) add to calibration time.

GPTQ W4A16 (the preset) on a random-weight Llama (6 layers, 768 wide, 2048 intermediate; 7
subgraphs), `--samples` x `--max-seq-len` tokens of local text, batch 4, oneshot timed alone, in
three variants, each run in a fresh process and interleaved round by round:

- off: llm-compressor's own `independent` pipeline, what the flow runs with
  `calibration.checkpoint_interval_s` negative;
- default: the resumable pipeline at the default interval (`CalibrationArgs`), what every run
  pays;
- every subgraph: interval 0, a save after each subgraph (finished layers + activations), the
  worst case.

    OMP_NUM_THREADS=1 python -m benchmarks.checkpoint_cost [--repeats 3] [--samples 32] [--max-seq-len 128]

Target: default / off <= 1.05 (issue #24). Medians; exits 1 when the target is missed.

    python -m benchmarks.checkpoint_cost --save-memory [--layers 8]

instead measures what one save holds: `--layers` decoder layers shaped as Llama-3.2-1B's (2048
wide, 8192 intermediate, float32: 232 MB each) finished since the last save, one save, in a
fresh process; how far its peak RSS rises above its RSS. Target: at most one layer's size (a
save holds one subgraph's tensors at a time, issue #23).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import median, own_peak_mb, print_result, run_child

TARGET_RATIO = 1.05
VARIANTS = ("off", "default", "every subgraph")


def one_run(variant: str, root: Path, samples: int, max_seq_len: int) -> None:
    """In a child process: calibrate once and print oneshot's seconds."""
    os.environ["COMPRESSFLOW_CACHE_DIR"] = str(root / "cache")
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.common import long_texts
    from benchmarks.flow_vs_bare import model_spec
    from compressflow.calibration.pipeline import resumable_pipeline
    from compressflow.calibration.resume import CalibrationCheckpoint, checkpoint_folder, discard
    from compressflow.demo.assets import build_tiny_llama
    from compressflow.params import CalibrationArgs, RecipeArgs
    from compressflow.recipes.render import render

    path = build_tiny_llama(root / "model", model_spec())
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts = long_texts(tokenizer, samples, max_seq_len)
    data = Dataset.from_dict(tokenizer(texts, truncation=True, max_length=max_seq_len))
    model = AutoModelForCausalLM.from_pretrained(path)
    kwargs = dict(
        dataset=data,
        num_calibration_samples=samples,
        shuffle_calibration_samples=False,
        batch_size=4,
    )
    interval = {"default": CalibrationArgs().checkpoint_interval_s, "every subgraph": 0}
    folder = checkpoint_folder(f"benchmark-{os.getpid()}") / "recipe"
    started, cpu_started = time.perf_counter(), time.process_time()
    if variant == "off":
        oneshot(model=model, processor=tokenizer, recipe=render(RecipeArgs()).yaml, **kwargs)
    else:
        checkpoint = CalibrationCheckpoint(folder, {"benchmark": True}, interval[variant])
        with resumable_pipeline(checkpoint, independent=True) as pipeline:
            oneshot(
                model=model,
                processor=tokenizer,
                recipe=render(RecipeArgs()).yaml,
                pipeline=pipeline,
                **kwargs,
            )
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    saved = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    discard(folder)
    print_result({"seconds": seconds, "cpu_seconds": cpu, "checkpoint_bytes": saved})


LLAMA_1B_LAYER = (
    [(2048, 2048), (2048, 512), (2048, 512), (2048, 2048)] + [(2048, 8192)] * 2 + [(8192, 2048)]
)


def save_memory(layers: int, root: Path) -> None:
    """In a child process: one save after `layers` Llama-3.2-1B-shaped decoder layers; print the
    weights it wrote and how far the peak RSS rose while it saved."""
    import torch

    from compressflow.calibration.resume import CalibrationCheckpoint
    from compressflow.store.identity import resume_key

    subgraphs = [
        [torch.nn.Linear(i, o, bias=False) for i, o in LLAMA_1B_LAYER] for _ in range(layers)
    ]
    model = torch.nn.ModuleList(torch.nn.ModuleList(modules) for modules in subgraphs)
    checkpoint = CalibrationCheckpoint(root / "save-memory", resume_key(run="m"), 1e9)
    for index, modules in enumerate(subgraphs):
        checkpoint.subgraph_done(model, 0, index, layers, modules, None)
    # This process's own counter: the kernel restarts its peak (VmHWM) from what it holds now.
    Path("/proc/self/clear_refs").write_text("5")
    before, started = own_peak_mb(), time.perf_counter()
    checkpoint.save(model, 0, layers - 1, layers, None)
    print_result(
        {
            "pending_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
            "layer_mb": sum(i * o * 4 for i, o in LLAMA_1B_LAYER) / 2**20,
            "growth_mb": own_peak_mb() - before,
            "seconds": time.perf_counter() - started,
        }
    )


def report_save_memory(layers: int) -> int:
    with tempfile.TemporaryDirectory(prefix="checkpoint-save-") as tmp:
        child = ["benchmarks.checkpoint_cost", "--save-memory-child", str(layers), tmp]
        result = run_child(child, dict(os.environ), Path(tmp) / "log.txt").result
    met = result["growth_mb"] <= result["layer_mb"]
    print(
        f"one save of {layers} layers ({result['pending_mb']:.0f} MB of weights) in "
        f"{result['seconds']:.1f} s: peak RSS +{result['growth_mb']:.0f} MB (target <= one "
        f"layer, {result['layer_mb']:.0f} MB): {'met' if met else 'MISSED'}"
    )
    return 0 if met else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--max-seq-len", type=int, default=128)
    parser.add_argument("--one", nargs=2, metavar=("VARIANT", "ROOT"), help=argparse.SUPPRESS)
    parser.add_argument("--save-memory", action="store_true", help="what one save holds")
    parser.add_argument("--layers", type=int, default=8, help="layers pending for --save-memory")
    parser.add_argument("--save-memory-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.save_memory_child:
        save_memory(int(args.save_memory_child[0]), Path(args.save_memory_child[1]))
        return 0
    if args.save_memory:
        return report_save_memory(args.layers)
    if args.one:
        one_run(args.one[0], Path(args.one[1]), args.samples, args.max_seq_len)
        return 0

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    seconds: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    cpu: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    saved: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="checkpoint-cost-") as tmp:
        root = Path(tmp)
        for repeat in range(args.repeats):
            for variant in VARIANTS:
                run = run_child(
                    [
                        "benchmarks.checkpoint_cost",
                        "--one",
                        variant,
                        str(root),
                        "--samples",
                        str(args.samples),
                        "--max-seq-len",
                        str(args.max_seq_len),
                    ],
                    env,
                    root / "logs" / f"{variant.replace(' ', '-')}-{repeat}.log",
                )
                seconds[variant].append(run.result["seconds"])
                cpu[variant].append(run.result["cpu_seconds"])
                saved[variant] = run.result["checkpoint_bytes"]
                print(
                    f"round {repeat + 1} {variant}: {run.result['seconds']:.2f} s, "
                    f"{run.result['cpu_seconds']:.2f} CPU s (load {run.load_before:.1f})",
                    flush=True,
                )

    off, off_cpu = median(seconds["off"]), median(cpu["off"])
    print(f"\nGPTQ W4A16, {args.samples} x {args.max_seq_len} tokens, {args.repeats} rounds")
    print(
        "| variant | calibration s (median) | runs | / off | CPU s (median) | / off "
        "| checkpoint MB at the end |"
    )
    print("|---|---|---|---|---|---|---|")
    for variant in VARIANTS:
        runs = ", ".join(f"{s:.2f}" for s in seconds[variant])
        wall, busy = median(seconds[variant]), median(cpu[variant])
        print(
            f"| {variant} | {wall:.2f} | {runs} | {wall / off:.3f} | {busy:.2f} "
            f"| {busy / off_cpu:.3f} | {saved[variant] / 2**20:.1f} |"
        )
    ratio = median(seconds["default"]) / off
    met = ratio <= TARGET_RATIO
    print(f"\ndefault / off = {ratio:.3f} (target <= {TARGET_RATIO}): {'met' if met else 'MISSED'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
