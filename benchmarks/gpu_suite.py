"""The GPU run of issue 42: the flow against bare scripts at the 1B and 8B shapes, one table.

`benchmarks/gpu.sh run` calls it on a lent GPU host after installing the carried wheels; it
also serves `gpu.sh prepare` (`--pins`, `--check-wheels`). Each step is one of the existing
benchmarks, run as a process group of its own that must end by its place in a fixed schedule
(the sum of the caps of the steps up to it, from the start): a step that hangs or overruns is
killed there, what its finished runs recorded (`--record`) is still reported, and the steps
after it keep their own time; a step that ends early leaves its time to the next.

    python -m benchmarks.gpu_suite [--smoke] [--budget-s 450] [--out DIR]

`--smoke` runs the same steps on the tiny `smoke` model with a few samples, on a CPU, to prove
the script before a GPU is lent. Prints: per step its status and seconds, then one table of
wall (flow, bare, ratio), peak host memory (the process tree's summed PSS) and peak GPU memory
in use (NVML, whole device, above each run's start) for each comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from benchmarks.common import REPO, refuse_foreign

WHEEL_LIST = REPO / "benchmarks" / "gpu-wheels.txt"
WORK_MARKER = ".gpu-suite-scratch"  # in --work: the folder is the suite's to empty
# Markers as the GPU image's interpreter evaluates them (CPython 3.12 on Linux x86_64).
TARGET_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
    "extra": "",
}


@dataclass
class Step:
    name: str
    argv: list[str]  # `python -m` arguments
    cap_s: float  # this step's share of the schedule on an H100
    smoke_cap_s: float  # on the 2-core CPU machine, beside other work
    flow: str = ""  # the record of the flow's run that the table compares ...
    bare: str = ""  # ... with this one; none for a build
    cleanup: list[str] = field(default_factory=list)  # folders under the work dir, after


def steps(work: Path, smoke: bool) -> list[Step]:
    """The schedule, with each step's cap on an H100 (the estimates behind them:
    docs/benchmarks/gpu.md, "The GPU script"): the 1B shape with 32 x 512 tokens, the 8B shape
    with 16 x 512 (GPTQ's time there is the layers', not the samples'), FP8 data-free on the same
    8B checkpoint without recounting verify's reads. GPTQ at 8B, the longest and least certain,
    comes last and gets whatever the others left."""
    one_b, eight_b = ("smoke", "smoke") if smoke else ("random-1b", "8b")
    samples_1b, samples_8b, seq = (8, 8, 128) if smoke else (32, 16, 512)
    w1, w8 = work / "1b", work / "8b"

    def build(name: str, folder: Path) -> list[str]:
        return ["benchmarks.common", name, str(folder / "model")]

    def gptq(shape: str, name: str, folder: Path, samples: int, cap_s: int, smoke_s: int):
        """flow_vs_bare, one round; the folder (model, outputs) is removed after it."""
        argv = [
            "benchmarks.flow_vs_bare",
            f"--model={name}",
            "--repeats=1",
            f"--samples={samples}",
            f"--max-seq-len={seq}",
            "--no-temporary-server",
            f"--workdir={folder}",
        ]
        label = f"GPTQ W4A16, {shape} shape"
        return Step(label, argv, cap_s, smoke_s, "flow cold", "bare", [folder.name])

    fp8 = ["benchmarks.large_model", "--only=fp8", f"--shape={eight_b}", "--no-reads"]
    # Issue 58: each scheme served beside the yardstick's 16-bit base by vLLM and measured by
    # `vllm bench serve`; where the host has no vLLM environment it says "not measured here".
    served = [
        "benchmarks.served_speed",
        "--presets=W8A8,FP8_DYNAMIC" if smoke else "--presets=W4A16,W8A8,FP8_DYNAMIC,MIX4.5",
        "--runs=1",
        *(
            ["--prompts=8", "--concurrency=1,4"]
            if smoke
            else ["--prompts=64", "--concurrency=1,8,32"]
        ),
        "--input-len=64" if smoke else "--input-len=120",
        f"--workdir={work / 'served'}",
    ]
    return [
        Step(f"build {one_b} (1B shape)", build(one_b, w1), 20, 60),
        gptq("1B", one_b, w1, samples_1b, 100, 300),
        Step(f"build {eight_b} (8B shape, bf16)", build(eight_b, w8), 35, 60),
        Step(
            "FP8_DYNAMIC data-free, 8B shape",
            [*fp8, f"--work={w8}"],
            100,
            240,
            flow="flow fp8",
            bare="bare fp8",
            cleanup=["8b/run-bare-fp8", "8b/run-flow-fp8"],  # caches, offload copies: disk
        ),
        Step("served speed on the yardstick (issue 58)", served, 120, 900, cleanup=["served"]),
        gptq("8B", eight_b, w8, samples_8b, 200, 300),
    ]


def run_step(step: Step, record: Path, log: Path, deadline: float, env: dict) -> str:
    """Run one step until it ends or `deadline` (monotonic) passes; its status."""
    remaining = deadline - time.monotonic()
    if remaining < 5:
        return "skipped: no time left in the schedule"
    argv = [sys.executable, "-m", *step.argv]
    if step.flow:
        argv.append(f"--record={record}")
    with log.open("w") as out:
        proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            return f"cut at its {remaining:.0f} s"
    return "ok" if code == 0 else f"exit {code}" + (" (a target missed)" if code == 1 else "")


def stop_group(proc: subprocess.Popen) -> None:
    """Stop the step and everything it started (servers, forkservers, children): SIGTERM to
    its process group, 10 s to exit, then SIGKILL to whatever of the group is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # the whole group is gone
            break
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def read_records(path: Path) -> dict[str, dict]:
    if not path.exists():
        return {}
    rows = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {row["variant"]: row for row in rows}


def comparison(step: Step, runs: dict[str, dict]) -> list[str]:
    """One table row: flow, bare and their ratio for wall, host memory and GPU memory."""
    flow, bare = runs.get(step.flow), runs.get(step.bare)

    def cell(key: str, unit: str) -> str:
        f = f"{flow[key]:.0f}" if flow else "-"
        b = f"{bare[key]:.0f}" if bare else "-"
        ratio = f"{flow[key] / bare[key]:.2f}" if flow and bare and bare[key] else "-"
        return f"{f} / {b} {unit} ({ratio})"

    warm = runs.get("flow warm")
    note = f"warm rerun {warm['wall_s']:.1f} s" if warm else ""
    return [
        step.name,
        cell("wall_s", "s"),
        cell("peak_tree_rss_mb", "MB"),
        cell("peak_gpu_mb", "MB"),
        note,
    ]


def gpu_name() -> str:
    try:
        answer = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "no GPU (nvidia-smi not found)"
    return answer.stdout.strip() or f"no GPU ({answer.stderr.strip()})"


def run_suite(args) -> int:
    work = Path(args.work)
    refuse_foreign(work, WORK_MARKER)  # emptied below: only a folder this suite made, or a new one
    shutil.rmtree(work, ignore_errors=True)  # a rerun measures cold runs, not reused outputs
    work.mkdir(parents=True)
    (work / WORK_MARKER).write_text("benchmarks/gpu_suite.py's scratch: emptied on every run\n")
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    logs = out or work
    env = dict(os.environ, PYTHONUNBUFFERED="1", COMPRESSFLOW_VLLM_PYTHON="off")
    lines = [f"GPU: {gpu_name()}", f"mode: {'smoke (CPU)' if args.smoke else 'GPU'}"]
    print("\n".join(lines), flush=True)
    started, schedule, rows = time.monotonic(), 0.0, []
    budget = args.budget_s or (900 if args.smoke else 450)
    for k, step in enumerate(steps(work, args.smoke)):
        schedule += step.smoke_cap_s if args.smoke else step.cap_s
        deadline = started + min(schedule, budget)
        record = work / f"step{k}.jsonl"
        mark = time.monotonic()
        # The served step uses the host's vLLM environment, where it has one.
        step_env = (
            env
            if step.argv[0] != "benchmarks.served_speed"
            else os.environ | {"PYTHONUNBUFFERED": "1"}
        )
        status = run_step(step, record, logs / f"step{k}.log", deadline, step_env)
        line = f"step {k} {step.name}: {status}, {time.monotonic() - mark:.0f} s"
        print(line, flush=True)
        lines.append(line)
        if status != "ok" and not status.startswith("exit 1 "):
            tail = (logs / f"step{k}.log").read_text(errors="replace")[-3000:]
            print(tail, flush=True)
        if step.flow:
            rows.append(comparison(step, read_records(record)))
        for folder in step.cleanup:
            shutil.rmtree(work / folder, ignore_errors=True)
    head = ["comparison", "wall: flow / bare (ratio)", "host PSS peak", "GPU peak", "note"]
    table = [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(row) + " |" for row in rows),
        f"total {time.monotonic() - started:.0f} s of the {budget:.0f} s schedule",
    ]
    print("\n" + "\n".join(table), flush=True)
    if out:
        (out / "table.md").write_text("\n".join(lines + [""] + table) + "\n")
    return 0


# --- prepare's side -----------------------------------------------------------------------------


def wheel_list() -> dict[str, list[str]]:
    """gpu-wheels.txt's sections: [carry] and [provided], names one a line."""
    sections: dict[str, list[str]] = {}
    current = None
    for raw in WHEEL_LIST.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if re.fullmatch(r"\[\w+\]", line):
            current = sections.setdefault(line[1:-1], [])
        elif line:
            current.append(line)
    return sections


def pins() -> list[str]:
    """name==version for each carried package, as this interpreter (.venv) has it installed."""
    return [f"{name}=={metadata.version(name)}" for name in wheel_list()["carry"]]


def check_wheels(folder: Path) -> list[str]:
    """What the downloaded wheels require that is neither carried nor provided by the image;
    empty when the set is closed. Extras count (prefect asks for `sqlalchemy[asyncio]`, which
    brings greenlet): a provided package's extras are read from this environment's copy."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename

    wheels = {canonicalize_name(parse_wheel_filename(w.name)[0]): w for w in folder.glob("*.whl")}
    have = set(wheels) | {canonicalize_name(n) for n in wheel_list()["provided"]}

    def requires(name: str) -> list[str]:
        if name not in wheels:
            return metadata.requires(name) or []
        with zipfile.ZipFile(wheels[name]) as archive:
            meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            text = archive.read(meta).decode()
        prefix = "Requires-Dist:"
        return [ln[len(prefix) :].strip() for ln in text.splitlines() if ln.startswith(prefix)]

    missing, todo, seen = [], [(name, "") for name in sorted(wheels)], set()
    while todo:
        name, extra = todo.pop()
        if (name, extra) in seen:
            continue
        seen.add((name, extra))
        for line in requires(name):
            req = Requirement(line)
            if req.marker and not req.marker.evaluate({**TARGET_ENV, "extra": extra}):
                continue
            if extra and not req.marker:
                continue  # the base requirements, walked with extra ""
            dep = canonicalize_name(req.name)
            if dep not in have:
                missing.append(f"{name} needs {req} (add it to [carry] in {WHEEL_LIST})")
            todo += [(dep, e) for e in req.extras]
    wanted = {canonicalize_name(n) for n in wheel_list()["carry"]}
    missing += [f"no wheel downloaded for {n}" for n in sorted(wanted - set(wheels))]
    return sorted(set(missing))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the tiny model, on a CPU")
    parser.add_argument("--work", default="/tmp/compressflow-gpu-suite", help="scratch folder")
    parser.add_argument("--out", help="also write the steps' logs and the table here")
    parser.add_argument(
        "--budget-s", type=float, help="end every step by this many seconds (450; smoke 900)"
    )
    parser.add_argument("--pins", action="store_true", help="print the carried wheels' pins")
    parser.add_argument("--check-wheels", metavar="DIR", help="check the wheel set in DIR")
    args = parser.parse_args(argv)
    if args.pins:
        print("\n".join(pins()))
        return 0
    if args.check_wheels:
        missing = check_wheels(Path(args.check_wheels))
        print("\n".join(missing) or "the wheel set is closed over the image's packages")
        return 1 if missing else 0
    return run_suite(args)


if __name__ == "__main__":
    sys.exit(main())
