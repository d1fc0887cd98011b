"""Children size their threads to the CPUs this worker may use, shared with the host's other
computing children (compressflow.model.cpus), never to the host's core count."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compressflow.model import cpus
from compressflow.runtime.isolation import in_child

AFFINITY = len(os.sched_getaffinity(0))


def cgroup(tmp_path: Path, membership: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A cgroup file system laid out under tmp_path, and a /proc/self/cgroup that points in it."""
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "proc-cgroup").write_text(membership)
    return root, tmp_path / "proc-cgroup"


@pytest.mark.parametrize(
    ("membership", "files", "expected"),
    [
        # cgroup v2: a 1.5-CPU quota runs two threads; "max" is no quota (None)
        ("0::/kubepods/pod1\n", {"kubepods/pod1/cpu.max": "150000 100000\n"}, 2),
        ("0::/kubepods/pod1\n", {"kubepods/pod1/cpu.max": "50000 100000\n"}, 1),
        ("0::/kubepods/pod1\n", {"kubepods/pod1/cpu.max": "max 100000\n"}, None),
        # a parent's quota limits its children
        (
            "0::/kubepods/pod1/c\n",
            {"kubepods/pod1/c/cpu.max": "max 100000\n", "kubepods/pod1/cpu.max": "100000 100000"},
            1,
        ),
        # cgroup v1, both mount names; -1 is no quota
        (
            "4:memory:/x\n1:cpu,cpuacct:/job\n",
            {
                "cpu,cpuacct/job/cpu.cfs_quota_us": "100000",
                "cpu,cpuacct/job/cpu.cfs_period_us": "100000",
            },
            1,
        ),
        (
            "1:cpu:/job\n",
            {"cpu/job/cpu.cfs_quota_us": "-1", "cpu/job/cpu.cfs_period_us": "100000"},
            None,
        ),
        ("1:cpu:/gone\n", {}, None),  # not readable here: no limit from it
    ],
)
def test_usable_cpus_is_the_smallest_of_affinity_and_quota(tmp_path, membership, files, expected):
    root, proc = cgroup(tmp_path, membership, files)
    count, why = cpus.usable_cpus(root, proc)
    # None: no quota applies, the affinity mask alone counts
    assert count == (AFFINITY if expected is None else min(expected, AFFINITY))
    assert "affinity mask" in why
    assert ("cgroup" in why) == (expected is not None)


def test_affinity_mask_limits_the_count():
    script = "from compressflow.model import cpus; print(cpus.usable_cpus()[0])"
    shown = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-c", script], capture_output=True, text=True
    )
    if shown.returncode and "taskset" in shown.stderr:
        pytest.skip("taskset is not usable here")
    assert shown.stdout.strip() == "1"


def holder(folder: Path) -> subprocess.Popen:
    """Another computing process on this host: a process that joined the ledger."""
    code = (
        "import sys, time; from pathlib import Path; from compressflow.model import cpus; "
        f"held = cpus.Ledger(Path({str(folder)!r})); held.join(); print('joined', flush=True); "
        "time.sleep(60)"
    )
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "joined"
    return process


def test_the_ledger_counts_live_holders_only_and_clears_dead_ones(tmp_path):
    folder = tmp_path / "ledger"
    ledger = cpus.Ledger(folder)
    assert ledger.live() == 0  # no folder yet
    assert ledger.join()
    other = holder(folder)
    try:
        assert ledger.live() == 2
    finally:
        other.kill()  # SIGKILL: it never removes its file
        other.wait()
    assert (folder / str(other.pid)).exists()
    assert ledger.live() == 1
    assert not (folder / str(other.pid)).exists()
    ledger.leave()
    assert ledger.live() == 0


def test_a_child_gives_up_cores_while_another_computes_and_takes_them_back(tmp_path, monkeypatch):
    monkeypatch.delenv(cpus.OVERRIDE, raising=False)
    before = torch.get_num_threads()
    threads = cpus.ChildThreads(cpus.Ledger(tmp_path / "ledger"))
    try:
        assert threads.current.threads == AFFINITY
        other = holder(tmp_path / "ledger")
        try:
            threads.refresh()
            assert threads.current.threads == max(1, AFFINITY // 2)
            assert torch.get_num_threads() == threads.current.threads
            assert os.environ["OMP_NUM_THREADS"] == str(threads.current.threads)
            assert "shared with 1 other" in threads.current.why
        finally:
            other.kill()
            other.wait()
        threads.refresh()
        assert threads.current.threads == AFFINITY
    finally:
        threads.close()
        torch.set_num_threads(before)


def test_a_fixed_count_is_used_as_is(monkeypatch, tmp_path):
    monkeypatch.setenv(cpus.OVERRIDE, "3")
    before = torch.get_num_threads()
    threads = cpus.ChildThreads(cpus.Ledger(tmp_path / "ledger"))
    try:
        assert threads.current == cpus.Share(3, f"fixed by {cpus.OVERRIDE}")
        assert torch.get_num_threads() == 3
        assert not (tmp_path / "ledger").exists()  # a fixed count takes no share
    finally:
        threads.close()
        torch.set_num_threads(before)


def child_threads() -> tuple[int, str, int, int]:
    return torch.get_num_threads(), os.environ["OMP_NUM_THREADS"], os.getpid(), cpus.Ledger().live()


def test_stage_children_run_at_their_share():
    """A real child of the forkserver, started while this process holds a place in the host's
    ledger (as another run's calibration would): it runs half the CPUs, or less where another test
    process's child computes beside them (`make unit` runs two)."""
    ledger = cpus.Ledger()
    assert ledger.join()
    try:
        threads, variable, pid, live = in_child(child_threads)
    finally:
        ledger.leave()
    assert live >= 2
    assert threads == max(1, AFFINITY // live)
    assert variable == str(threads)
    assert not (ledger.folder / str(pid)).exists()  # the child left as it ended
