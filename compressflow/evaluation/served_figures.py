"""What served-performance measurements say: `vllm bench serve`'s result JSON read into
SERVED_METRICS, medians and spreads over the repeats, the verdict, and the facts vLLM's server
log states (the linear kernel it chose, the weights' memory, the KV cache's capacity).

No processes here (compressflow/evaluation/served.py runs vLLM): everything takes text or
parsed JSON, so the unit tests read recorded results and logs.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter

from compressflow.evaluation.result import SERVED_METRICS, ServedFigure, ServedLevel

# vLLM's own log lines (0.32), each found in its source:
# model_executor/kernels/linear/__init__.py (scaled-mm int8 / FP8 kernels, NVFP4, W8A16 FP8):
#   "Selected %s for %s"  (kernel class, layer)
# compressed_tensors schemes (WNA16, W4A8, ...) and the mixed-precision chooser:
#   "Using %s for %s"     (kernel class, scheme)
# model_executor/layers/utils.py, vLLM-CPU's unquantized GEMM (a debug line; served.py turns it
# on for that one logger): "CPU unquantized GEMM dispatch: using %s"
SELECTED = re.compile(r"Selected (\w+) for ([\w.\-]+)")
USING = re.compile(r"Using (\w+(?:Kernel|Linear\w*|Experts\w*)) for ([\w .\-]+?)\s*$")
CPU_DENSE = re.compile(r"CPU unquantized GEMM dispatch: using (.+?)\s*$", re.MULTILINE)
# v1/worker/gpu_model_runner.py: "Model loading took %s GiB memory and %.6f seconds"
LOADING = re.compile(r"Model loading took ([\d.]+) GiB memory")
# v1/core/kv_cache_utils.py: "%s KV cache size: %s tokens, ..." ("GPU", or "CPU" on vLLM-CPU)
KV_CACHE = re.compile(r"(\w+) KV cache size: ([\d,]+) tokens")
# GPU-less platforms vLLM's unquantized path has no kernel line for (it calls torch's linear).
DENSE_GPU = "torch linear (cuBLAS), unquantized"


def bench_metrics(result: dict) -> dict[str, float]:
    """SERVED_METRICS from one `vllm bench serve --save-result` JSON; ValueError naming what is
    missing, or the failed requests (a figure over fewer requests than asked is no figure)."""
    failed = result.get("failed", 0)
    if failed:
        errors = [error for error in result.get("errors") or [] if error]
        raise ValueError(
            f"vllm bench serve: {failed} of {failed + result.get('completed', 0)} requests "
            f"failed" + (f": {str(errors[0]).strip().splitlines()[-1][:300]}" if errors else "")
        )
    found = {}
    for name, (key, _, _) in SERVED_METRICS.items():
        value = result.get(key)
        if not isinstance(value, int | float):
            raise ValueError(f"vllm bench serve's result has no {key!r} (got {value!r})")
        found[name] = float(value)
    return found


def figure(values: list[float]) -> ServedFigure:
    """One metric over the repeats, in the order measured."""
    return ServedFigure(
        median=statistics.median(values), low=min(values), high=max(values), values=list(values)
    )


def verdict(base: ServedFigure, compressed: ServedFigure) -> str:
    """'no measurable difference' where the throughput ranges overlap: a difference inside the
    repeats' own spread is not a speed-up."""
    if compressed.low <= base.high and base.low <= compressed.high:
        return "no measurable difference"
    return "faster" if compressed.median > base.median else "slower"


def served_level(
    concurrency: int, base_runs: list[dict[str, float]], compressed_runs: list[dict[str, float]]
) -> ServedLevel:
    """Both models at one concurrency level, from each repeat's bench_metrics."""

    def figures(runs: list[dict[str, float]]) -> dict[str, ServedFigure]:
        return {name: figure([run[name] for run in runs]) for name in SERVED_METRICS}

    base, compressed = figures(base_runs), figures(compressed_runs)
    throughput = "output_throughput"
    return ServedLevel(
        concurrency=concurrency,
        base=base,
        compressed=compressed,
        throughput_ratio=compressed[throughput].median / base[throughput].median,
        verdict=verdict(base[throughput], compressed[throughput]),
    )


def linear_kernel(log: str, on_gpu: bool) -> str:
    """The linear kernel(s) vLLM's server log says it chose, most used first, e.g.
    'CPUInt8ScaledMMLinearKernel (12 layers); oneDNN onednn_mm (unquantized)'; the unquantized
    path's own words where it logged them; '' when the log names none."""
    chosen: Counter[str] = Counter()
    for line in log.splitlines():
        if found := SELECTED.search(line):
            chosen[found.group(1)] += 1
        elif found := USING.search(line):
            chosen[found.group(1)] += 1
    named = [
        f"{kernel} ({count} layers)" if count > 1 else kernel
        for kernel, count in chosen.most_common()
    ]
    dense = CPU_DENSE.search(log)
    if dense:
        named.append(f"{dense.group(1)} (unquantized)")
    elif on_gpu:
        named.append(DENSE_GPU)
    return "; ".join(named)


def weights_memory_gib(log: str) -> float | None:
    """The weights' memory vLLM reported loading them ('Model loading took ... GiB'; GPU
    runners say it, vLLM-CPU's does not)."""
    found = LOADING.findall(log)
    return float(found[-1]) if found else None


def kv_cache_tokens(log: str) -> int | None:
    """The GPU KV cache's capacity in tokens vLLM reported; None on CPU, where a setting
    (VLLM_CPU_KVCACHE_SPACE) fixes it, so it is not a result."""
    for pool, tokens in KV_CACHE.findall(log):
        if pool == "GPU":
            return int(tokens.replace(",", ""))
    return None
