"""Benchmark: what the kept compile cache (compressflow.model.compile_cache) saves the processes
of ours that compile.

Two do: an AutoRound calibration (torch.compile of its block forward) and a vLLM serving check
(vLLM's sampler). Each compiles in a cache of its own, never the host's shared one; cold is that
cache empty, as every run's was before the kept cache; warm is it seeded from what an earlier
run kept. Interleaved rounds, a fresh process each:

- AutoRound: the compress-model flow, W4A16_AUTOROUND with `iters` 2, on the tiny Llama
  (`demo.assets.build_tiny_llama`), 32 x 32 tokens; the calibrate stage's seconds and the
  process's wall;
- vLLM: the serving child (`compressflow.model.serving.run_child`) scoring the tiny Llama on 4
  prompts, its wall; skipped without the vLLM environment (`make vllm-env`).

    python -m benchmarks.compile_cache [--repeats 2] [--only autoround|vllm] [--workdir DIR]

Run it as `make` runs things, with PYTHONDONTWRITEBYTECODE unset: with it set, every vLLM child
compiles vLLM's modules to bytecode again, seconds that hide what this measures.

Targets: warm <= 0.5 x cold for the AutoRound calibration, warm <= 0.8 x cold for the vLLM
child. Medians; exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import median, print_result, run_child
from benchmarks.refusal_time import build_model

TARGET_AUTOROUND = 0.5
TARGET_VLLM = 0.8


def autoround_run(root: Path, cache: Path, model: Path) -> None:
    """In a child process: one AutoRound compression with `cache` as the compressflow cache."""
    os.environ.update(
        PREFECT_HOME=str(root / "prefect"),
        CLEARML_OFFLINE_MODE="1",
        CLEARML_CACHE_DIR=str(root / "clearml"),
        COMPRESSFLOW_CACHE_DIR=str(cache),
        COMPRESSFLOW_TRACKING="0",
        COMPRESSFLOW_VLLM_PYTHON="off",
        HF_HUB_OFFLINE="1",
        PREFECT_LOGGING_LEVEL="WARNING",
    )
    from prefect.testing.utilities import prefect_test_harness

    from compressflow.flows.compress import compress

    with prefect_test_harness(server_startup_timeout=120):
        published = compress(
            model={"model_id": str(model)},
            dataset={"text_samples": 32, "max_seq_len": 32},
            recipe={"preset": "W4A16_AUTOROUND", "recipe_args": {"iters": 2}},
            output={"save_directory": tempfile.mkdtemp(dir=root) + "/out"},
        )
    (calibrate,) = [s for s in published.stages if s.name == "calibrate"]
    print_result({"calibrate_s": calibrate.seconds})


def vllm_seconds(model: Path, cache: Path) -> float | None:
    """One serving child's wall with `cache` as the compressflow cache; None without vLLM."""
    os.environ["COMPRESSFLOW_CACHE_DIR"] = str(cache)
    from compressflow.model import serving

    python = serving.vllm_python()
    if python is None:
        return None
    prompts = [[1, *range(5 + i, 200 + i, 7)] for i in range(4)]
    started = time.perf_counter()
    output, stderr = serving.run_child(
        {"model": {"path": str(model), "prompts": prompts}}, False, python, timeout=600
    )
    if not output.get("models"):
        raise RuntimeError(f"the vLLM child scored nothing: {stderr[-2000:]}")
    return time.perf_counter() - started


def autoround_figures(root: Path, cache: Path, model: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    command = ["benchmarks.compile_cache", "--autoround-run", str(root), str(cache), str(model)]
    run = run_child(command, env, root / "log.txt")
    return {"calibrate s": run.result["calibrate_s"], "wall s": run.wall_s}


def vllm_figures(root: Path, cache: Path, model: Path) -> dict[str, float]:
    seconds = vllm_seconds(model, cache)
    return {} if seconds is None else {"wall s": seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", choices=["autoround", "vllm"], default=None)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--autoround-run", nargs=3, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.autoround_run:
        autoround_run(*args.autoround_run)
        return 0

    work = args.workdir or Path(tempfile.mkdtemp(prefix="compressflow-compile-cache-"))
    model = build_model(work / "model")
    parts = {"autoround": autoround_figures, "vllm": vllm_figures}
    figures: dict[str, list[float]] = {}
    for part, measure in parts.items():
        if args.only not in (None, part):
            continue
        # Each part's own caches: AutoRound's kept code holds kernels vLLM compiles too.
        warm = work / part / "warm-cache"
        measure(work / part / "fill", warm, model)  # what the warm rounds start from
        for round_ in range(1, args.repeats + 1):
            for variant in ("cold", "warm"):
                root = work / part / f"{variant}-{round_}"
                cache = warm if variant == "warm" else root / "cache"
                for name, value in measure(root, cache, model).items():
                    figures.setdefault(f"{part} {variant} {name}", []).append(value)
            print(f"{part}: round {round_} done", flush=True)

    print("\n| figure | median | rounds |\n|---|---|---|")
    for name, values in figures.items():
        print(f"| {name} | {median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} |")
    missed = []
    for what, target in (("autoround", TARGET_AUTOROUND), ("vllm", TARGET_VLLM)):
        key = "calibrate s" if what == "autoround" else "wall s"
        if f"{what} cold {key}" not in figures:
            why = (
                " (no vLLM environment: `make vllm-env`)"
                if what == "vllm" and not args.only
                else ""
            )
            print(f"{what}: not measured{why}")
            continue
        ratio = median(figures[f"{what} warm {key}"]) / median(figures[f"{what} cold {key}"])
        met = ratio <= target
        print(
            f"{what}: warm / cold {key} = {ratio:.2f} (target <= {target}) {'met' if met else 'MISSED'}"
        )
        missed += [] if met else [what]
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
