"""How many threads a computing child may run: the CPUs this worker was given, shared fairly.

torch, OpenMP and tokenizers size their pools to the host's cores. In a pod with a 4-CPU limit on
a 64-core node that is 64 spinning threads a child; with two flows on a 2-core host it is four.
torch's OpenMP threads spin while they wait for one another, so a thread whose partner was
descheduled burns its core: two demos at once calibrated 7.5x slower than one alone, where
sharing two cores costs 2x.

So each child sizes itself to what this worker may use, the smallest of:
- its affinity mask (`os.sched_getaffinity`: taskset, a Kubernetes static CPU manager, cpusets);
- its cgroup CPU quota (`cpu.max` on cgroup v2, `cpu.cfs_quota_us` / `cpu.cfs_period_us` on v1),
  rounded up: a 1.5-CPU quota runs 2 threads;
and divides that among the children computing on this host at the moment. Each computing child
holds a lock on a file of its own in a folder shared by the host's workers (the system's
temporary folder); counting the files whose lock is held counts the live children, and a killed
child's lock goes with it, so nothing stale is counted. A child re-counts at each progress event
(a calibrated layer), so one that started alone gives up cores when another starts, and takes
them back when it ends.

`COMPRESSFLOW_THREADS` (a worker setting) or `calibration.threads` (a run's calibration) fixes the
count instead.
"""

from __future__ import annotations

import fcntl
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from compressflow.settings import settings, variable

# What the libraries read when their pools start; children set them so that what they start
# (vLLM, torchrun, tokenizers' rayon pool) starts at the share too.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS")
OVERRIDE = variable("threads")
LEDGER = "compressflow-cpu-share"


@dataclass(frozen=True)
class Share:
    """The threads a child runs, and why that many (for the log, the plan and the manifest)."""

    threads: int
    why: str


CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def _cgroup_quota(root: Path, membership: Path) -> tuple[float, str] | None:
    """(CPUs, where it was read) of this process's cgroup CPU quota; None when it has none.

    `membership` lists this process's cgroups (/proc/self/cgroup), `root` is where they are
    mounted.
    """
    for line in _read(membership).splitlines():
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        path = path.lstrip("/")
        if hierarchy == "0" and not controllers:  # cgroup v2: "max 100000" or "50000 100000"
            for folder in _up_from(root / path, root):
                quota, _, period = _read(folder / "cpu.max").partition(" ")
                if quota.isdigit() and period.strip().isdigit():
                    return int(quota) / int(period), f"cgroup v2 cpu.max {quota} {period.strip()}"
        elif "cpu" in controllers.split(","):  # cgroup v1: quota -1 when unlimited
            for base in (root / "cpu,cpuacct", root / "cpu"):
                for folder in _up_from(base / path, base):
                    quota = _read(folder / "cpu.cfs_quota_us").strip()
                    period = _read(folder / "cpu.cfs_period_us").strip()
                    if quota.isdigit() and period.isdigit() and int(period):
                        return int(quota) / int(period), (
                            f"cgroup v1 cpu.cfs_quota_us {quota} / cpu.cfs_period_us {period}"
                        )
    return None


def _up_from(folder: Path, root: Path) -> list[Path]:
    """`folder` and its parents up to `root`: a parent's quota limits its children too."""
    chain = [folder]
    while chain[-1] != root and root in chain[-1].parents:
        chain.append(chain[-1].parent)
    return chain


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:  # no such controller, or not readable here: no limit from it
        return ""


def usable_cpus(root: Path = CGROUP_ROOT, membership: Path = PROC_CGROUP) -> tuple[int, str]:
    """(CPUs this process may use, why): its affinity mask and cgroup quota, not the host's."""
    affinity = len(os.sched_getaffinity(0))
    why = [f"{affinity} CPU(s) in this worker's affinity mask"]
    cpus = affinity
    quota = _cgroup_quota(root, membership)
    if quota is not None:
        allowed, where = quota
        why.append(f"{allowed:g} by its {where}")
        cpus = max(1, min(cpus, math.ceil(allowed)))
    return cpus, ", ".join(why)


class Ledger:
    """The computing children of this host, one locked file each (see the module docstring)."""

    def __init__(self, folder: Path | None = None):
        self.folder = folder or Path(tempfile.gettempdir()) / LEDGER
        self._file = None

    def join(self) -> bool:
        """Count this process in; False when the folder cannot be used (then it counts alone)."""
        mine = self.folder / str(os.getpid())
        try:
            try:  # for every user's workers, as /tmp is (umask aside); another may make it first
                self.folder.mkdir()
                self.folder.chmod(0o1777)
            except FileExistsError:
                pass
            # Locked before it takes its counted name: a counter never sees it unlocked (and
            # removes it as a dead child's).
            handle = open(mine.with_suffix(".new"), "w")  # held for this process's life
            fcntl.flock(handle, fcntl.LOCK_EX)
            mine.with_suffix(".new").rename(mine)
        except OSError:
            return False
        self._file = handle
        return True

    def live(self) -> int:
        """How many children hold their file's lock now (this one included, once joined); 0
        when the folder cannot be read."""
        count = 0
        try:
            entries = list(self.folder.iterdir())
        except OSError:
            return 0
        for entry in entries:
            if not entry.name.isdigit():
                continue  # one being joined
            if self._file is not None and entry.name == str(os.getpid()):
                count += 1
                continue
            try:
                with open(entry) as other:
                    fcntl.flock(other, fcntl.LOCK_SH | fcntl.LOCK_NB)
                # Not held: a child killed before it could remove its file.
                entry.unlink(missing_ok=True)
            except BlockingIOError:
                count += 1  # held: a live child
            except OSError:  # gone meanwhile, or another user's: theirs to remove
                continue
        return count

    def leave(self) -> None:
        if self._file is not None:
            (self.folder / str(os.getpid())).unlink(missing_ok=True)
            self._file.close()
            self._file = None


def fixed() -> int | None:
    """The count `COMPRESSFLOW_THREADS` fixes, or None (share automatically)."""
    return settings().threads


def share(ledger: Ledger | None = None, joining: bool = False) -> Share:
    """A child's threads: the fixed count, else the usable CPUs over the live children.

    `joining`: for a process about to join (`ledger` does not count it yet).
    """
    if (count := fixed()) is not None:
        return Share(count, f"fixed by {OVERRIDE}")
    cpus, why = usable_cpus()
    others = max(0, ledger.live() - (not joining)) if ledger is not None else 0
    if others:
        why += f", shared with {others} other computing process(es) on this host"
    return Share(max(1, cpus // (others + 1)), why)


def apply(threads: int) -> None:
    """Size this process's pools, and what it starts, to `threads`."""
    for name in THREAD_VARIABLES:
        os.environ[name] = str(threads)
    import torch  # imported already in a child (the forkserver preloads it): no cost

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


class ChildThreads:
    """A computing child's share, kept fair while it runs (`refresh` at each progress event)."""

    def __init__(self, ledger: Ledger | None = None):
        self.ledger = ledger if ledger is not None else Ledger()
        self.automatic = fixed() is None
        if self.automatic:
            self.ledger.join()
        self.current = share(self.ledger if self.automatic else None)
        apply(self.current.threads)

    def refresh(self) -> None:
        if not self.automatic:
            return
        now = share(self.ledger)
        if now.threads != self.current.threads:
            apply(now.threads)
        self.current = now

    def close(self) -> None:
        self.ledger.leave()
