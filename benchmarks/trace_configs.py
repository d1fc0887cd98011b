"""Benchmark: the traceability check on Llama-3.1 8B, 70B and 405B-sized configs, no weights.

Each (config, repeat) runs in a fresh subprocess, so the peak RSS (getrusage ru_maxrss) is that
config's alone: it is the whole process's peak, imports of torch, transformers and llm-compressor
included (about 450 MB of it), which is what a worker running the check really needs. Seconds are
`TraceReport.seconds`: building the model on the meta device plus tracing, imports excluded.

    python -m benchmarks.trace_configs [--repeats 3] [--configs 8B 70B 405B] [--tokens 512]

Targets: under 10 s and under 1 GB per config. Exits 1 when a config misses one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.common import LLAMA_3_1, LLAMA_3_1_VOCAB

TARGET_SECONDS = 10.0
TARGET_RSS_MB = 1024.0
# Llama 3.1's rope: llama3 scaling of a 500k theta from an 8k to a 128k context.
ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
CONFIGS = LLAMA_3_1
RESULT_PREFIX = "TRACE_RESULT "


def llama_config(name: str):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=LLAMA_3_1_VOCAB,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters=dict(ROPE),
        bos_token_id=128000,
        eos_token_id=128001,
        tie_word_embeddings=False,
        **CONFIGS[name],
    )


def run_one(name: str, tokens: int) -> None:
    """Child process: trace one config and print its report on a marked line."""
    import torch

    from compressflow.model.tracing import trace_config

    # A fixed, spread-out sample within the vocabulary: tracing needs shapes, not meaning.
    ids = (torch.arange(tokens) * 7919).remainder(LLAMA_3_1_VOCAB).unsqueeze(0)
    sample = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    report = trace_config(llama_config(name), sample, model_class="LlamaForCausalLM")
    print(RESULT_PREFIX + report.model_dump_json(), flush=True)


def measure(name: str, tokens: int) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.trace_configs", "--child", name]
    cmd += ["--tokens", str(tokens)]
    proc = subprocess.run(
        cmd, cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True
    )
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    raise RuntimeError(f"{name}: child exited {proc.returncode}:\n{proc.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--tokens", type=int, default=512, help="sample length")
    parser.add_argument("--child", choices=list(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run_one(args.child, args.tokens)
        return 0

    header = (
        f"{'config':<6} {'layers':>6} {'subgraphs':>9} {'median s':>9} {'max s':>7} "
        f"{'peak RSS MB':>11} {'trace +MB':>9}  target (<{TARGET_SECONDS:g} s, <1 GB)"
    )
    print(f"{args.repeats} fresh processes per config, {args.tokens}-token sample")
    print(header)
    print("-" * len(header))
    all_met = True
    for name in args.configs:
        runs = [measure(name, args.tokens) for _ in range(args.repeats)]
        seconds = [r["seconds"] for r in runs]
        peak = max(r["peak_rss_mb"] for r in runs)
        growth = max(r["rss_growth_mb"] for r in runs)
        median = statistics.median(seconds)
        met = median < TARGET_SECONDS and peak < TARGET_RSS_MB
        all_met &= met
        print(
            f"{name:<6} {CONFIGS[name]['num_hidden_layers']:>6} {runs[0]['subgraphs']:>9} "
            f"{median:>9.2f} {max(seconds):>7.2f} {peak:>11.0f} {growth:>9.0f}  "
            f"{'met' if met else 'MISSED'}"
        )
    return 0 if all_met else 1


if __name__ == "__main__":
    sys.exit(main())
