"""Benchmark: our dataset build against llm-compressor's own preprocessing, on the same texts.

512 samples of local text (the standard library's docstrings, chunked so each reaches 2048
tokens with the demo tokenizer) in a JSON-lines file, tokenized to 2048 tokens:

- compressflow:  `compressflow.data.build.build` (what the stage runs in its child, no
                 Prefect): config check, tokenizer, load the file, seeded sampling, batched
                 tokenization, fingerprint over every token, `save_to_disk` into the cache;
- llm-compressor: what `oneshot(dataset=...)` does with a text dataset: the tokenizer, the file
                 through `datasets.load_dataset("json")`, then `get_processed_dataset` (its
                 TextGenerationDataset registry) and `format_calibration_data` (the dataloader).

Each (variant, repeat) runs in a fresh process with its own datasets and compressflow caches,
so nothing is reused between repeats. "build s" is timed inside the process, imports excluded
(they are the same libraries, plus llm-compressor or Prefect); wall s is the whole process.

    python -m benchmarks.dataset_build [--repeats 5] [--samples 512] [--tokens 2048]

Target: compressflow no slower than llm-compressor (median build s ratio <= 1.0). Exits 1 if not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import long_texts, median, print_result, run_child, write_jsonl
from compressflow.results import FetchedModel

MODULE = "benchmarks.dataset_build"
VARIANTS = ("compressflow", "llm-compressor")


def ours(args) -> dict:
    # Imported before the clock starts, as in `theirs`: `build` imports these lazily.
    import datasets  # noqa: F401
    import numpy  # noqa: F401
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401

    from compressflow.data.build import build
    from compressflow.params import DatasetArgs
    from compressflow.settings import cache_root

    model = FetchedModel(
        path=args.model,
        source="local",
        model_id=args.model,
        identity="sha256:benchmark",
        size_bytes=0,
    )
    started = time.perf_counter()
    built = build(
        DatasetArgs(dataset_name=args.data, text_samples=args.samples, max_seq_len=args.tokens),
        model,
        cache_root() / "datasets",
    )
    return {
        "build_s": time.perf_counter() - started,
        "samples": built.num_samples,
        "min_tokens": built.token_stats["min"],
        "total_tokens": built.token_stats["total"],
    }


def theirs(args) -> dict:
    from datasets import load_dataset
    from llmcompressor.args import DatasetArguments
    from llmcompressor.datasets.utils import (
        format_calibration_data,
        get_processed_dataset,
    )
    from transformers import AutoTokenizer

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dataset_args = DatasetArguments(
        dataset=load_dataset("json", data_files=args.data, split="train"),
        max_seq_length=args.tokens,
        num_calibration_samples=args.samples,
    )
    tokenized = get_processed_dataset(dataset_args, processor=tokenizer)
    format_calibration_data(dataset_args, tokenized, tokenizer)
    lengths = [len(ids) for ids in tokenized["input_ids"]]
    return {
        "build_s": time.perf_counter() - started,
        "samples": len(lengths),
        "min_tokens": min(lengths),
        "total_tokens": sum(lengths),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print_result((ours if args.child == "compressflow" else theirs)(args))
        return 0

    from transformers import AutoTokenizer

    from compressflow.demo.assets import build_tiny_llama

    work = Path(tempfile.mkdtemp(prefix="compressflow-dataset-bench-"))
    model = build_tiny_llama(work / "model")  # the demo model: its tokenizer is what matters
    texts = long_texts(AutoTokenizer.from_pretrained(model), args.samples, args.tokens)
    data = write_jsonl(work / "texts.jsonl", texts)
    print(
        f"{args.samples} samples x {args.tokens} tokens from {data} "
        f"({data.stat().st_size / 2**20:.1f} MB); {args.repeats} fresh processes per variant"
    )

    runs = {v: [] for v in VARIANTS}
    for r in range(args.repeats):
        for variant in VARIANTS:  # interleaved: both see the same machine load
            folder = work / f"{variant}-{r}"
            env = {
                **os.environ,
                "HF_HOME": str(folder / "hf"),
                "HF_HUB_OFFLINE": "1",
                "COMPRESSFLOW_CACHE_DIR": str(folder / "cache"),
            }
            cmd = [
                MODULE,
                "--child",
                variant,
                "--model",
                str(model),
                "--data",
                str(data),
                "--samples",
                str(args.samples),
                "--tokens",
                str(args.tokens),
            ]
            run = run_child(cmd, env, folder / "child.log")
            runs[variant].append(run)
            print(
                f"  {r + 1} {variant:<15} build {run.result['build_s']:6.2f} s  process "
                f"{run.wall_s:5.1f} s  {run.peak_rss_mb:5.0f} MB  "
                f"min tokens {run.result['min_tokens']}",
                flush=True,
            )

    print(f"\n{'variant':<15} {'build s':>8} {'process s':>10} {'peak RSS MB':>12} {'tokens':>9}")
    build_s = {}
    for variant, rs in runs.items():
        build_s[variant] = median(x.result["build_s"] for x in rs)
        print(
            f"{variant:<15} {build_s[variant]:>8.2f} {median(x.wall_s for x in rs):>10.1f} "
            f"{median(x.peak_rss_mb for x in rs):>12.0f} {rs[0].result['total_tokens']:>9}"
        )
    ratio = build_s["compressflow"] / build_s["llm-compressor"]
    print(
        f"\ncompressflow / llm-compressor build time: {ratio:.2f} (target <= 1.00: "
        f"{'met' if ratio <= 1.0 else 'MISSED'})"
    )
    shutil.rmtree(work, ignore_errors=True)
    return 0 if ratio <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
