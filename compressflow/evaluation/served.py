"""Served performance: the base and the compressed model, each served by `vllm serve` with the
same flags in the vLLM environment, measured by vLLM's own benchmark (`vllm bench serve`).

The workload is fixed by ServedArgs: prompts cut from the held-out texts (`held_out_prompts`),
a stated input and output length (end of sequence ignored), a few concurrency levels, a seed,
and repeats interleaved base / compressed, each repeat in the other order. Both servers stay up
for the whole measurement (one started per model, not per repeat: a start costs a minute on a
CPU), and every `vllm bench serve` run goes through one process (vllm_cli.py --each), which pays
vLLM's import once. Figures, the verdict and what the server logs state are read in
served_figures.py.

What vLLM says ends in one of three statuses, never an exception:
- measured: both served, every request of every run completed;
- not measured here: this host cannot (no vLLM environment, a kernel its vLLM build lacks,
  a base it does not serve either, FP8 on torch's reference kernel past the time allowed, or
  served.timeout_minutes ran out): vLLM's reason, never a verdict on the model;
- failed: vLLM would not serve the compressed model, or a run failed, with its root-cause line.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import tempfile
import time
from pathlib import Path

from compressflow.data.result import HeldOutText
from compressflow.evaluation import served_figures as figures
from compressflow.evaluation.args import ServedArgs
from compressflow.evaluation.result import ServedPerformance
from compressflow.evaluation.served_servers import (
    CLI,
    HOST,
    OutOfTime,
    Server,
    run_benches,
    server_environment,
    wait_healthy,
)
from compressflow.model import serving
from compressflow.model.headers import tensor_index
from compressflow.settings import settings

SERVED_NAME = "served"  # the model's name in the API, the same for both servers
# Two servers share one GPU: each gets this fraction of its memory (vLLM's default is 0.9 for
# one), so their weights and KV caches fit side by side and the repeats can interleave.
GPU_SHARE = 0.42
WARMUPS = 2  # requests `vllm bench serve` sends before it measures


def prompt_windows(input_ids: list[list[int]], length: int) -> list[list[int]]:
    """Non-overlapping `length`-token windows cut from each text; where no text is that long,
    from the texts joined end to end."""
    windows = [
        ids[start : start + length]
        for ids in input_ids
        for start in range(0, len(ids) - length + 1, length)
    ]
    if windows:
        return windows
    joined = [token for ids in input_ids for token in ids]
    return [joined[start : start + length] for start in range(0, len(joined) - length + 1, length)]


def held_out_prompts(
    held_out: HeldOutText, tokenizer_path: str | Path, args: ServedArgs
) -> list[str]:
    """`args.prompts` prompts of `args.input_len` tokens cut from the held-out token ids, chosen
    by `args.seed` and decoded with the base model's tokenizer (loads transformers: run it in a
    child). Distinct where the texts allow, repeated where they are fewer."""
    from transformers import AutoTokenizer

    windows = prompt_windows(held_out.input_ids, args.input_len)
    if not windows:
        raise ValueError(
            f"served.input_len: the held-out texts hold "
            f"{sum(map(len, held_out.input_ids))} tokens in all, fewer than one prompt of "
            f"{args.input_len}; lower served.input_len or give more held-out text"
        )
    random.Random(args.seed).shuffle(windows)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    texts = tokenizer.batch_decode(windows[: args.prompts], skip_special_tokens=True)
    return [texts[number % len(texts)] for number in range(args.prompts)]


def serve_flags(args: ServedArgs, on_cpu: bool, max_model_len: int) -> list[str]:
    """The `vllm serve` flags both models run with (model, port and log aside)."""
    flags = [
        "--host", HOST,
        "--served-model-name", SERVED_NAME,
        "--dtype", "bfloat16",
        "--max-model-len", str(max_model_len),
        "--seed", str(args.seed),
    ]  # fmt: skip
    if on_cpu:
        # vLLM-CPU compiles the model at start (a minute on 2 cores) for little gain at these
        # sizes; eager for both keeps the comparison fair and the measurement bounded.
        return [*flags, "--enforce-eager"]
    return [*flags, "--gpu-memory-utilization", str(GPU_SHARE)]


def max_model_len(base: Path, args: ServedArgs) -> int:
    """Input plus output, and room for the few tokens decoding and re-tokenizing a prompt
    may add (a BOS, a split merge), within the model's own context."""
    wanted = args.input_len + args.output_len + max(16, args.input_len // 8)
    return min(wanted, serving.max_positions(base))


def bench_argv(
    server: Server, tokenizer: Path, dataset: Path, concurrency: int, args: ServedArgs, name: str
) -> list[str]:
    """One `vllm bench serve` run against `server`, its result saved as `name`."""
    return [
        "bench", "serve",
        "--backend", "openai",
        "--base-url", server.url,
        "--endpoint", "/v1/completions",
        "--model", SERVED_NAME,
        "--tokenizer", str(tokenizer),
        "--dataset-name", "custom",
        "--dataset-path", str(dataset),
        "--skip-chat-template",
        "--custom-output-len", str(args.output_len),
        "--ignore-eos",
        "--max-concurrency", str(concurrency),
        "--num-prompts", str(args.prompts),
        "--num-warmups", str(WARMUPS),
        "--seed", str(args.seed),
        "--percentile-metrics", "ttft,itl",
        "--metric-percentiles", "50,95",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",  # each request's error, where one failed
        "--result-dir", str(dataset.parent),
        "--result-filename", name,
    ]  # fmt: skip


def plan(args: ServedArgs) -> list[tuple[int, int, str]]:
    """(repeat, concurrency, which) in the order measured: each level alternates the models,
    and each repeat starts with the other one, so drift (a neighbour's load, a warming cache)
    falls on both."""
    order = [("base", "compressed"), ("compressed", "base")]
    return [
        (repeat, level, which)
        for repeat in range(args.repeats)
        for level in args.concurrency
        for which in order[repeat % 2]
    ]


def describe_device(on_cpu: bool) -> str:
    if on_cpu:
        model = next(
            (
                line.partition(":")[2].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            "CPU",
        )
        return f"{model} ({serving.child_threads()} threads a server, {os.cpu_count()} cores)"
    try:
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.split("\n")  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "GPU"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    index = int(visible) if visible.isdigit() and int(visible) < len(names) else 0
    return names[index].strip() or "GPU"


def no_vllm_here() -> ServedPerformance | None:
    """'Not measured here' when this worker has no vLLM environment, said before anything is
    prepared for it; None when it has one."""
    if settings().vllm_python_path() is not None:
        return None
    return ServedPerformance(status="not measured here", reason=settings().vllm_missing_reason())


def serve_and_measure(
    base: Path, compressed: Path, prompts: list[str], args: ServedArgs
) -> ServedPerformance:
    """Serve `base` and `compressed` with identical `vllm serve` flags and measure both with
    `vllm bench serve` on `prompts`; never raises for what vLLM says."""
    started = time.monotonic()
    if missing := no_vllm_here():
        return missing
    python = settings().vllm_python_path()
    on_cpu = serving.runs_on_cpu(python)
    installed = serving.installed_vllm(python)
    limit = args.timeout_minutes * 60 or math.inf
    context = max_model_len(base, args)
    common = dict(
        device=describe_device(on_cpu),
        backend=f"vLLM {installed[1] if installed else '?'} ({'CPU' if on_cpu else 'GPU'})",
        serve_flags=serve_flags(args, on_cpu, context),
        workload={**args.model_dump(exclude={"measure", "timeout_minutes"}), "warmups": WARMUPS},
    )
    if args.input_len + args.output_len > context:
        return ServedPerformance(
            status="failed",
            reason=f"served.input_len + served.output_len ({args.input_len + args.output_len}) "
            f"exceed the base model's context ({context} tokens): lower them",
            **common,
        )
    tokens = (
        len(plan(args)) // 2 * (args.prompts + WARMUPS + 1) * (args.input_len + args.output_len)
    )
    if slow := serving.too_slow_reason(compressed, tokens, limit, python):
        return ServedPerformance(
            status="not measured here",
            reason=slow.replace("COMPRESSFLOW_VLLM_TIMEOUT_SECONDS", "served.timeout_minutes"),
            **common,
        )
    with tempfile.TemporaryDirectory(prefix="compressflow-served-") as work:
        try:
            found = measure(Path(work), base, compressed, prompts, args, common, started + limit)
        except OutOfTime:
            found = ServedPerformance(
                status="not measured here",
                reason=f"stopped after {args.timeout_minutes:g} minutes (served.timeout_minutes): "
                "raise it, or lower served.prompts / repeats / concurrency",
                **common,
            )
    found.seconds = round(time.monotonic() - started, 1)
    return found


def measure(
    work: Path,
    base: Path,
    compressed: Path,
    prompts: list[str],
    args: ServedArgs,
    common: dict,
    deadline: float,
) -> ServedPerformance:
    """Start both servers, run every benchmark, read the results; stops both in any case."""
    python = settings().vllm_python_path()
    dataset = work / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in prompts))
    env = server_environment(work)
    on_cpu = common["backend"].endswith("(CPU)")
    servers: dict[str, Server] = {}
    try:
        for which, model in (("base", base), ("compressed", compressed)):
            command = [str(python), str(CLI), "serve", str(model.resolve())]
            servers[which] = Server(
                which, [*command, *common["serve_flags"]], env, work / f"{which}-serve.log"
            )
            # On a GPU one at a time: vLLM sizes its KV cache from the memory it finds free, and
            # a neighbour still loading would make that figure a race. On a CPU both at once.
            if not on_cpu and (died := wait_healthy([servers[which]], deadline)):
                return judge_died(died, common)
        if on_cpu and (died := wait_healthy(list(servers.values()), deadline)):
            return judge_died(died, common)
        runs = [
            bench_argv(servers[which], base, dataset, level, args, run_name(repeat, level, which))
            for repeat, level, which in plan(args)
        ]
        failure = run_benches(python, runs, dataset, env, deadline)
        logs = {which: server.log() for which, server in servers.items()}
        # A server that stopped under load (a kernel missing at the first forward) says why.
        if died := next((s for s in servers.values() if s.process.poll() is not None), None):
            return judge_died(died, common)
        if failure:
            return ServedPerformance(status="failed", reason=failure, **common)
        found = read_runs(work, args, logs, {"base": base, "compressed": compressed}, common)
    finally:
        for server in servers.values():
            server.stop()
    serving.keep_compiled(work)
    return found


def judge_died(died: Server, common: dict) -> ServedPerformance:
    """What a server that exited (at start, or at its first requests) means, in vLLM's words."""
    log = died.log()
    error = serving.last_error_lines(log)
    if limit := serving.kernel_limit_in_log(log):
        return ServedPerformance(status="not measured here", reason=limit, **common)
    if died.which == "base":
        return ServedPerformance(
            status="not measured here",
            reason=f"this vLLM build does not serve the base model ({error})",
            **common,
        )
    return ServedPerformance(
        status="failed", reason=f"vLLM did not serve the compressed model: {error}", **common
    )


def run_name(repeat: int, level: int, which: str) -> str:
    return f"{which}-c{level}-r{repeat}.json"


# Bytes a weight takes in the server: 16-bit floats whatever the checkpoint stores them as (both
# models are served with --dtype bfloat16); packed integers and FP8 as stored.
SERVED_FLOAT = {"F64": 2, "F32": 2, "F16": 2, "BF16": 2}
STORED = {"I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def checkpoint_gib(folder: Path) -> float | None:
    """The weights' memory a server holds for the checkpoint at `folder`, from its safetensors
    headers; None when a tensor's type is one we cannot size (no guess)."""
    total = 0
    for info in tensor_index(folder).values():
        size = SERVED_FLOAT.get(info.dtype) or STORED.get(info.dtype)
        if size is None and not info.dtype.startswith("F8_"):
            return None
        total += math.prod(info.shape) * (size or 1)
    return total / 2**30 if total else None


def read_runs(
    work: Path,
    args: ServedArgs,
    logs: dict[str, str],
    folders: dict[str, Path],
    common: dict,
) -> ServedPerformance:
    """The saved results of every run, as figures per level, and what the logs state."""
    runs: dict[tuple[int, str], list[dict[str, float]]] = {}
    try:
        for repeat, level, which in plan(args):
            result = json.loads((work / run_name(repeat, level, which)).read_text())
            runs.setdefault((level, which), []).append(figures.bench_metrics(result))
    except (OSError, ValueError) as error:
        return ServedPerformance(status="failed", reason=str(error), **common)
    on_gpu = not common["backend"].endswith("(CPU)")
    kernels = {which: figures.linear_kernel(log, on_gpu) for which, log in logs.items()}
    memory = {which: figures.weights_memory_gib(log) for which, log in logs.items()}
    source = "vLLM's report"
    if not any(memory.values()):  # vLLM-CPU reports none: what it holds, from the headers
        memory = {which: checkpoint_gib(folder) for which, folder in folders.items()}
        source = "the checkpoint's tensors at the served dtype (vLLM-CPU reports none)"
    kv_cache = {which: figures.kv_cache_tokens(log) for which, log in logs.items()}
    return ServedPerformance(
        status="measured",
        kernels={which: kernel for which, kernel in kernels.items() if kernel},
        levels=[
            figures.served_level(level, runs[level, "base"], runs[level, "compressed"])
            for level in args.concurrency
        ],
        weights_memory_gib={which: gib for which, gib in memory.items() if gib is not None},
        weights_memory_source=source,
        kv_cache_tokens={which: tokens for which, tokens in kv_cache.items() if tokens is not None},
        **common,
    )
