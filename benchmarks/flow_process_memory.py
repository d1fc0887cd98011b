"""Benchmark: the flow process's own peak memory, against the floor a Prefect flow process sets.

The flow's process holds Prefect and the ClearML SDK; every library that touches weights runs in
its children (issue #23). Four variants, each a separate process, its own peak (`VmHWM`, read at
its end: the children's memory is not in it):

- trivial flow:          a Prefect flow of 12 tasks that do nothing: the floor of any flow process;
- trivial + ClearML:     the same inside an offline ClearML task;
- compress:              one real compress-model run of a small random Llama (W4A16, 16 x 64
                         tokens, vLLM off), clearml imported as compressflow does;
- compress with pandas:  the same, with clearml's optional pandas and pyarrow imported as the
                         SDK does by itself (`tracking.CLEARML_OPTIONAL = ()`).

    python -m benchmarks.flow_process_memory [--repeats 1]

Each process starts Prefect's temporary server (a child, not counted). Memory needs no learned
weights and is little disturbed by a busy machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from benchmarks.common import median, own_peak_mb, print_result, run_child

VARIANTS = ("trivial flow", "trivial + ClearML", "compress", "compress with pandas")


def child(variant: str, model: str, work: Path) -> None:
    from prefect import flow, task

    from compressflow.reporting import tracking

    @task
    def stage(i: int) -> int:
        return i

    @flow
    def trivial() -> list[int]:
        return [stage(i) for i in range(12)]

    if variant == "trivial flow":
        trivial()
    elif variant == "trivial + ClearML":
        with tracking.open_run("benchmarks", "floor", []):
            trivial()
    else:
        if variant == "compress with pandas":
            tracking.CLEARML_OPTIONAL = ()
        from compressflow.flows.compress import compress

        compress(
            model={"model_id": model},
            dataset={"dataset_name": "python_docs", "text_samples": 16, "max_seq_len": 64},
            recipe={"preset": "W4A16"},
            output={"save_directory": str(work / "out")},
            verify={"vllm": "off"},
        )
    print_result({"peak_mb": own_peak_mb(), "pandas": "pandas" in sys.modules})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.model, Path(args.work))
        return

    from compressflow.demo.assets import build_tiny_llama

    root = Path(tempfile.mkdtemp(prefix="flow-process-memory-"))
    model = build_tiny_llama(root / "model")
    peaks: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for round_ in range(args.repeats):
        for number, variant in enumerate(VARIANTS):
            work = root / f"r{round_}-{number}"
            env = {
                **os.environ,
                "HOME": str(work),  # ClearML's offline sessions and configuration
                "CLEARML_OFFLINE_MODE": "1",
                "PREFECT_HOME": str(work / "prefect"),
                "COMPRESSFLOW_CACHE_DIR": str(work / "cache"),
                "COMPRESSFLOW_VLLM_PYTHON": "off",
            }
            env.pop("PREFECT_API_URL", None)
            run = run_child(
                [
                    "benchmarks.flow_process_memory",
                    "--child",
                    variant,
                    "--model",
                    str(model),
                    "--work",
                    str(work),
                ],
                env,
                work / "log.txt",
            )
            peaks[variant].append(run.result["peak_mb"])
            print(f"round {round_ + 1} {variant}: {run.result['peak_mb']:.0f} MB", flush=True)
    print("\n| flow process | median peak MB (VmHWM) |\n|---|---|")
    for variant in VARIANTS:
        print(f"| {variant} | {median(peaks[variant]):.0f} |")
    saved = median(peaks["compress with pandas"]) - median(peaks["compress"])
    above = median(peaks["compress"]) - median(peaks["trivial flow"])
    print(
        f"\npandas and pyarrow left out: -{saved:.0f} MB; compress above the floor: +{above:.0f} MB"
    )


if __name__ == "__main__":
    main()
