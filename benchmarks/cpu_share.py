"""Benchmark: threads sized to the CPUs a worker may use, against the best fixed thread count.

The compress-model flow (W4A16, a random-weight 6-layer 768-wide Llama) in two situations that
used to make torch's threads fight over cores (compressflow.model.cpus says why):

- two at once: two flows started together on this host, each against the same Prefect server;
  the figure is the time until both have finished;
- under a quota: one flow in a cgroup whose CPU quota is one CPU (cgroup v2 `cpu.max` or v1
  `cpu.cfs_quota_us`; needs root, skipped without it), on a host with more cores than that.

Each runs with the automatic count (`auto`) and with `COMPRESSFLOW_THREADS` fixed at 1 and at
the host's core count, interleaved, `--repeats` rounds; medians. Target (issue 37): `auto` at
most 1.1x the best fixed count in each situation. Exits 1 when missed.

    python -m benchmarks.cpu_share [--repeats 2] [--samples 32] [--max-seq-len 256]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, RESULT_PREFIX, median, start_server, stop_server
from benchmarks.flow_vs_bare import base_env, child_args, flow_env, prepare

TARGET_RATIO = 1.1
QUOTA_CPUS = 1


def quota_cgroup(name: str) -> Path | None:
    """A cgroup limited to QUOTA_CPUS, made for this benchmark; None where it cannot be made."""
    v2, v1 = Path("/sys/fs/cgroup/cgroup.controllers"), Path("/sys/fs/cgroup/cpu")
    try:
        if v2.exists():
            folder = v2.parent / name
            folder.mkdir(exist_ok=True)
            (folder / "cpu.max").write_text(f"{QUOTA_CPUS * 100000} 100000")
        elif v1.is_dir():
            folder = v1 / name
            folder.mkdir(exist_ok=True)
            (folder / "cpu.cfs_period_us").write_text("100000")
            (folder / "cpu.cfs_quota_us").write_text(str(QUOTA_CPUS * 100000))
        else:
            return None
    except OSError as error:
        print(f"no cgroup with a CPU quota here ({error}): the quota case is skipped")
        return None
    return folder


def remove_cgroup(folder: Path) -> None:
    """Remove the quota cgroup once its last process (a flow's forkserver exits after the flow)
    has left it."""
    deadline = time.monotonic() + 30
    while (folder / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.5)
    try:
        folder.rmdir()
    except OSError as error:
        print(f"could not remove {folder} ({error}): remove it by hand")


def start(args: list[str], env: dict[str, str], log: Path, cgroup: Path | None):
    def enter() -> None:  # in the child, before exec: it and all it starts are in the cgroup
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    return subprocess.Popen(
        [sys.executable, "-m", *args],
        cwd=REPO,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        preexec_fn=enter if cgroup else None,
    )


def calibrate_seconds(log: Path) -> float:
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])["phases"]["calibrate"]
    raise RuntimeError(f"no result in {log}:\n{log.read_text(errors='replace')[-3000:]}")


def run_case(name, count, threads, work, inputs, env, api_url, cgroup, args) -> tuple[float, float]:
    """(seconds until every flow finished, median calibrate stage) of `count` flows at once."""
    model, data, recipe = inputs
    folder = work / f"{name}-{threads}-{time.monotonic_ns()}"
    processes = []
    started = time.perf_counter()
    for k in range(count):
        run_env = flow_env(env, folder / f"flow-{k}", api_url)
        if threads != "auto":
            run_env["COMPRESSFLOW_THREADS"] = threads
        out = folder / f"flow-{k}" / "out"
        log = folder / f"flow-{k}.log"
        processes.append(
            (start(child_args("flow", model, data, recipe, out, args), run_env, log, cgroup), log)
        )
    for process, log in processes:
        if process.wait():
            raise RuntimeError(f"a flow exited {process.returncode}; see {log}")
    wall = time.perf_counter() - started
    return wall, median(calibrate_seconds(log) for _, log in processes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--workdir", help="keep everything here (default: a temporary folder)")
    args = parser.parse_args(argv)
    args.model, args.flow_batch_size = "random", 0  # what flow_vs_bare's children read

    work = Path(args.workdir or tempfile.mkdtemp(prefix="compressflow-cpu-share-"))
    work.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    inputs = prepare(work, args)
    env = base_env(work)
    (work / "prefect-server").mkdir(exist_ok=True)
    server, api_url = start_server(work / "prefect-server", env)
    cgroup = quota_cgroup(f"compressflow-bench-{os.getpid()}") if cores > QUOTA_CPUS else None
    cases = [("two at once", 2, None)] + ([("under a quota", 1, cgroup)] if cgroup else [])
    counts = ["auto", "1", str(cores)]
    print(f"work folder {work}; {cores} cores; {args.samples} x {args.max_seq_len} tokens, W4A16")
    found: dict[tuple[str, str], list[tuple[float, float]]] = {}
    try:
        for r in range(1, args.repeats + 1):
            for name, count, group in cases:
                for threads in counts:
                    wall, calibrate = run_case(
                        name, count, threads, work, inputs, env, api_url, group, args
                    )
                    found.setdefault((name, threads), []).append((wall, calibrate))
                    print(
                        f"  round {r} {name:<14} threads {threads:<4} {wall:6.1f} s until done, "
                        f"calibrate {calibrate:5.1f} s",
                        flush=True,
                    )
    finally:
        stop_server(server)
        if cgroup:
            remove_cgroup(cgroup)
    return 0 if report(found, [name for name, _, _ in cases], counts, args.repeats) else 1


def report(found: dict, cases: list[str], counts: list[str], repeats: int) -> bool:
    """Print the medians and whether auto is within TARGET_RATIO of the best fixed count."""
    met = True
    print(f"\nmedians of {repeats} round(s): auto against the best fixed count")
    for name in cases:
        walls = {t: median(w for w, _ in found[name, t]) for t in counts}
        best = min((t for t in counts if t != "auto"), key=walls.get)
        ratio = walls["auto"] / walls[best]
        met &= ratio <= TARGET_RATIO
        shown = ", ".join(f"{t}: {walls[t]:.1f} s" for t in counts)
        print(
            f"  {name:<14} {shown}; auto / best fixed ({best}) {ratio:.3f} (target <= "
            f"{TARGET_RATIO}: {'met' if ratio <= TARGET_RATIO else 'MISSED'})"
        )
    return met


if __name__ == "__main__":
    sys.exit(main())
