"""Shared pieces of the benchmarks: long local texts, measured child processes, result lines.

Every variant a benchmark compares runs as a whole separate process started here, so its wall
time includes the imports and start-up a user pays, and its peak RSS is that process's own
(`os.wait4` returns the rusage of exactly the child it waited for). Its whole process tree's
peak is measured twice: summed PSS, sampled (`TreeSampler`), and anonymous memory, counted by the
kernel in a cgroup of its own (`AnonPeak`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from compressflow.data.local_text import python_docs

REPO = Path(__file__).resolve().parent.parent
RESULT_PREFIX = "BENCH_RESULT "

# Llama 3.1's layer shapes and vocabulary, from the meta-llama/Llama-3.1-*B config.json files.
LLAMA_3_1 = {
    "8B": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    "70B": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
    ),
    "405B": dict(
        hidden_size=16384,
        intermediate_size=53248,
        num_hidden_layers=126,
        num_attention_heads=128,
        num_key_value_heads=8,
    ),
}
LLAMA_3_1_VOCAB = 128256

# The random-weight Llamas the benchmarks build, by name: LlamaConfig's shape, plus `vocab_size`
# (default: the demo tokenizer's size) and `dtype` (default float32). random: the issue's
# benchmark size; random-1b: Llama-3.2-1B's layers (a 2k vocabulary) for a GPU host, where the
# small model's calibration takes seconds and the fixed overhead is all one sees; 8b:
# Llama-3.1-8B's shape in bf16 (16 GB); smoke: 8b's code path at a size a CPU runs in seconds
# (`benchmarks/gpu.sh run --smoke`).
RANDOM_MODELS = {
    "random": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=6,
        num_attention_heads=12,
        num_key_value_heads=4,
    ),
    "random-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    "8b": dict(**LLAMA_3_1["8B"], vocab_size=LLAMA_3_1_VOCAB, dtype="bfloat16"),
    "smoke": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4096,
        dtype="bfloat16",
    ),
}


def refuse_foreign(folder: Path, marker: str) -> None:
    """SystemExit when `folder` holds files but not `marker`, the file a benchmark writes into
    the folders it makes: only those may be written over or emptied, never a user's model."""
    if folder.is_dir() and any(folder.iterdir()) and not (folder / marker).exists():
        raise SystemExit(
            f"{folder} holds files a benchmark did not write (no {marker}); give it a new or "
            "empty folder"
        )


def build_random_llama(
    path: Path, shape: dict, tokenizer_vocab: int = 2048, shard: str = "5GB"
) -> Path:
    """A random-weight Llama of `shape` (a `RANDOM_MODELS` entry) with the demo's tokenizer,
    saved in `shard`-sized files, unless one with the same shape is already at `path`.

    Initialised on the GPU where there is one: 8B parameters take a second there and minutes on
    the CPU, so a GPU host's time goes to saving them (16 GB). Run it in a process of its own
    before measuring: the builder's peak and its CUDA context would otherwise stay in the parent.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from compressflow.demo.assets import build_tokenizer

    marker = path / "random_llama.json"
    wanted = {**shape, "tokenizer_vocab": tokenizer_vocab}
    if marker.exists() and json.loads(marker.read_text()) == wanted:
        return path
    refuse_foreign(path, marker.name)  # save_pretrained writes over config.json and weights
    tokenizer = build_tokenizer(tokenizer_vocab)
    layout = {k: v for k, v in shape.items() if k not in ("vocab_size", "dtype")}
    config = LlamaConfig(
        vocab_size=shape.get("vocab_size", len(tokenizer)),
        **layout,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, shape.get("dtype", "float32")))  # made in it, not cast
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(path, max_shard_size=shard)
    tokenizer.save_pretrained(path)
    marker.write_text(json.dumps(wanted))  # written last: its presence means complete
    return path


def long_texts(tokenizer, samples: int, tokens: int) -> list[str]:
    """`samples` texts that each tokenize to at least `tokens` tokens with `tokenizer`.

    The standard library's docstrings, joined and cut into consecutive windows of the token
    stream (wrapping around: 512 x 2048 tokens is about ten times the text there is). Each window
    is 10% longer than asked, since decoding and re-encoding may merge a few tokens differently.
    """
    stream = tokenizer("\n\n".join(python_docs()), add_special_tokens=False)["input_ids"]
    window = tokens + tokens // 10 + 8
    texts = []
    for k in range(samples):
        start = (k * window) % len(stream)
        ids = (stream[start:] + stream)[:window]
        texts.append(tokenizer.decode(ids))
    return texts


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@dataclass
class ChildRun:
    wall_s: float
    cpu_s: float  # user + system: less disturbed than wall time by other work on the machine
    peak_rss_mb: float  # the largest single process of the tree (what ru_maxrss reports)
    load_before: float  # 1-minute load average when the child started
    result: dict
    peak_tree_rss_mb: float = 0.0  # the most the whole process tree held at once (PSS, sampled)
    peak_tree_anon_mb: float = 0.0  # the tree's anonymous memory at its peak (AnonPeak); 0: n/a
    peak_gpu_mb: float = 0.0  # GPU memory in use at the peak, above the child's start; 0: no GPU
    peak_parts_mb: dict = field(default_factory=dict)  # the PSS peak by process (TreeSampler.role)
    cpu_parts_s: dict = field(default_factory=dict)  # CPU s by role, each process as last sampled

    @property
    def tree_cpu_s(self) -> float:
        """The whole tree's CPU seconds: wait4's count misses a forkserver and the children it
        forked, which the child started and left to exit with it, unreaped. Other subprocesses
        are reaped by the child, so wait4 counts them already."""
        unseen = ("forkserver", "children")
        return self.cpu_s + sum(s for role, s in self.cpu_parts_s.items() if role in unseen)


# Reading one process's PSS costs the kernel about 4 ms (it walks the page tables); a flow's tree
# of four to six processes read every 50 ms took 30% of a core from the run it measured, and more
# from the flow than from a one-process bare script. Memory peaks here last seconds (a shard, a
# layer, a load), so 250 ms still finds them.
SAMPLE_S = 0.25


def gpu_used_bytes() -> int | None:
    """GPU memory in use on every NVIDIA device of this host (NVML), or None without one.

    Device-wide, not per process: in a container NVML often cannot map its processes to ours,
    and a flow's tree may hold a CUDA context in more than one process, each of which counts.
    """
    try:
        import pynvml  # nvidia-ml-py, an llm-compressor dependency
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        return sum(pynvml.nvmlDeviceGetMemoryInfo(h).used for h in handles) if handles else None
    except pynvml.NVMLError:  # no NVIDIA driver: a CPU host
        return None


class TreeSampler(threading.Thread):
    """Samples the summed PSS of a process and its descendants every `SAMPLE_S` seconds, and the
    GPU memory in use above what was in use when it started (`gpu_used_bytes`).

    ru_maxrss is per process: a flow whose calibration runs in a child (or a Prefect temporary
    server beside it) would hide memory held by two processes at once. Summing RSS would count
    twice the pages a forked child shares with its forkserver (torch and llm-compressor, imported
    once); PSS splits shared pages among the processes sharing them, so the sum is what the
    machine must have.
    """

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.done = pid, 0, threading.Event()
        self.parts: dict[str, int] = {}  # the peak's PSS by `role`
        self.cpu: dict[int, tuple[str, float]] = {}  # each process's role and CPU s, last seen
        self.gpu_base, self.gpu_peak = gpu_used_bytes(), 0

    def role(self, process) -> str:
        """What a process of the tree is, for the peak's breakdown: the flow's own, its
        forkserver (whose library pages its children share), the children the forkserver
        forked, the resource tracker, or another subprocess (a temporary Prefect server)."""
        if process.pid == self.pid:
            return "process"
        # The root's own child this process is or descends from: a forked child keeps its
        # forkserver's command line, so only the root's direct children are told by theirs.
        top = next((p for p in [process, *process.parents()] if p.ppid() == self.pid), None)
        if top is None:  # its parent exited and it was re-parented: no longer the run's
            return "subprocess"
        command = " ".join(top.cmdline())
        kind = next(
            (
                name
                for name in ("forkserver", "resource_tracker")
                if f"{name} import main" in command
            ),
            "subprocess",
        )
        if top is process:
            return kind.replace("_", " ")
        return "children" if kind == "forkserver" else "subprocess"

    def cpu_by_role(self) -> dict[str, float]:
        """CPU seconds by role: what wait4 cannot see, a forkserver's children's (the last
        quarter second of each is missed)."""
        total: dict[str, float] = {}
        for role, seconds in self.cpu.values():
            total[role] = total.get(role, 0.0) + seconds
        return total

    def run(self) -> None:
        import psutil

        while not self.done.wait(SAMPLE_S):
            if self.gpu_base is not None:
                self.gpu_peak = max(self.gpu_peak, (gpu_used_bytes() or 0) - self.gpu_base)
            try:
                root = psutil.Process(self.pid)
                tree = [root, *root.children(recursive=True)]
                parts: dict[str, int] = {}
                for process in tree:
                    try:
                        role = self.role(process)
                        parts[role] = parts.get(role, 0) + process.memory_full_info().pss
                        times = process.cpu_times()
                        self.cpu[process.pid] = (role, times.user + times.system)
                    except psutil.Error:  # exited between listing and reading
                        pass
                if sum(parts.values()) > self.peak:
                    self.peak, self.parts = sum(parts.values()), parts
            except psutil.Error:
                return


def _memory_cgroup() -> Path | None:
    """A new cgroup v1 memory cgroup under this process's own; None where there is none or this
    process may not make one (not root, cgroup v2), and only the PSS sampler runs."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    path = next((ln.split(":", 2)[2] for ln in lines if ln.split(":")[1] == "memory"), None)
    if path is None:
        return None
    folder = Path(f"/sys/fs/cgroup/memory{path}/compressflow-bench-{time.monotonic_ns()}")
    try:
        folder.mkdir()
    except OSError:
        return None
    return folder


class AnonPeak(threading.Thread):
    """The most anonymous memory a child and all its descendants held at once, counted exactly.

    The child starts in a memory cgroup of its own, where the kernel charges every page once,
    whichever processes share it (a forkserver and the children forked from it), so reading one
    counter every 20 ms costs microseconds and misses no peak that lasts longer; the PSS sampler
    reads every 250 ms and missed 70 MB of a bare script's 821 MB peak. Anonymous only: a file
    page (a library, a memory-mapped weight) is charged to whichever cgroup read it first, often
    an earlier run, so counting those would depend on what ran before.
    """

    def __init__(self):
        super().__init__(daemon=True)
        self.cgroup, self.peak, self.done = _memory_cgroup(), 0, threading.Event()

    def watch(self, pid: int) -> None:
        """Move the child just started into the cgroup and start counting. What it touched
        before (its interpreter's first milliseconds) stays charged where it was: this kernel
        moves no charges (`move_charge_at_immigrate` is refused). Not `Popen(preexec_fn=...)`,
        which is unsafe in a process with threads."""
        if self.cgroup:
            (self.cgroup / "cgroup.procs").write_text(str(pid))
        self.start()

    def run(self) -> None:
        while self.cgroup and not self.done.wait(0.02):
            stat = (self.cgroup / "memory.stat").read_text()
            held = int(re.search(r"^total_rss (\d+)", stat, re.M).group(1))
            self.peak = max(self.peak, held)

    def stop(self) -> None:
        """After the child's exit: wait for what it left (a forkserver notices a moment later),
        then remove the cgroup (the kernel moves its charges up)."""
        if self.cgroup:
            procs, deadline = self.cgroup / "cgroup.procs", time.monotonic() + 30
            while procs.read_text().strip() and time.monotonic() < deadline:
                time.sleep(0.1)
        self.done.set()
        if self.is_alive():
            self.join()
        if self.cgroup:
            self.cgroup.rmdir()


def run_child(args: list[str], env: dict[str, str], log_path: Path) -> ChildRun:
    """Run `python -m <args>` to completion; its wall time, its own peak RSS, its result line."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    with log_path.open("w") as log:
        started = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", *args], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        anon = AnonPeak()
        anon.watch(proc.pid)
        sampler = TreeSampler(proc.pid)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
        sampler.done.set()
        anon.stop()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4, not by Popen
    output = log_path.read_text(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(args)} exited {proc.returncode}; log {log_path}:\n{output[-4000:]}"
        )
    result = next(
        (
            json.loads(line[len(RESULT_PREFIX) :])
            for line in output.splitlines()
            if line.startswith(RESULT_PREFIX)
        ),
        {},
    )
    return ChildRun(
        wall_s=wall,
        cpu_s=usage.ru_utime + usage.ru_stime,
        peak_rss_mb=usage.ru_maxrss / 1024,
        load_before=load_before,
        result=result,
        peak_tree_rss_mb=sampler.peak / 2**20,
        peak_tree_anon_mb=anon.peak / 2**20,
        peak_gpu_mb=sampler.gpu_peak / 2**20,
        peak_parts_mb={role: pss / 2**20 for role, pss in sampler.parts.items()},
        cpu_parts_s=sampler.cpu_by_role(),
    )


def record(path: str | None, variant: str, run: ChildRun) -> None:
    """Append one finished run's figures to `path` (a benchmark's `--record`) as a JSON line,
    as soon as it ends: `benchmarks/gpu.sh` builds its table from them, also when a step was cut
    short by its time limit after some of its runs."""
    if path:
        with open(path, "a") as out:
            out.write(json.dumps({"variant": variant, **vars(run)}) + "\n")


def own_peak_mb() -> float:
    """This process's own peak resident memory, exact (`VmHWM`), children not counted.

    Not ru_maxrss: a process started with fork and exec keeps its launcher's peak there.
    """
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024


def print_result(result: dict) -> None:
    """Child side of `run_child`: one marked JSON line on stdout."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def median(values) -> float:
    return statistics.median(values)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(home: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """`prefect server start` on a free port with its own PREFECT_HOME; waits until healthy."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    log = (home / "server.log").open("w")
    proc = subprocess.Popen(
        [  # `-m`: an environment installed without console scripts (`pip --target`) has no `prefect`
            sys.executable,
            "-m",
            "prefect",
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        env={**env, "PREFECT_HOME": str(home)},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited {proc.returncode}; see {home}/server.log")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"prefect server did not become healthy in 180 s; see {home}/server.log")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def build_in_child(path: Path, name: str, layers: int | None = None) -> Path:
    """`build_random_llama(path, RANDOM_MODELS[name])` in a process of its own (see there), with
    `layers` decoder layers instead of the shape's where given."""
    command = [sys.executable, "-m", "benchmarks.common", name, str(path)]
    subprocess.run(command + ([str(layers)] if layers else []), cwd=REPO, check=True)
    return path


if __name__ == "__main__":  # python -m benchmarks.common NAME FOLDER [LAYERS]: build it there
    shape = dict(RANDOM_MODELS[sys.argv[1]])
    if len(sys.argv) > 3:
        shape["num_hidden_layers"] = int(sys.argv[3])
    build_random_llama(Path(sys.argv[2]), shape)
