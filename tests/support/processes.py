"""Processes of their own: flows and scripts a test starts (a SIGKILL, a second writer or a
file-size limit needs one), their output read line by line, and what a run leaves behind."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def flow_env(home: Path) -> dict[str, str]:
    """The session's environment, pointed at the test server and at caches under `home`."""
    from prefect.settings import PREFECT_API_URL

    return {
        **os.environ,
        "PREFECT_API_URL": PREFECT_API_URL.value(),  # no temporary server: saves ~20 s a process
        "PREFECT_HOME": str(home / "prefect"),  # result storage, so cache records are shared
        "COMPRESSFLOW_CACHE_DIR": str(home / "cache"),
        "PYTHONPATH": str(REPO),
    }


def start(script: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        env=env or {**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, so a kill takes its children too
    )


class Output:
    """Collects a process's output lines in a thread; `wait_for` blocks until a line matches."""

    def __init__(self, process: subprocess.Popen):
        self.process, self.lines, self.changed = process, [], threading.Condition()
        self.ended = False
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
        with self.changed:
            self.ended = True
            self.changed.notify_all()

    def wait_for(self, pattern: str, timeout: float = 180) -> str:
        regex = re.compile(pattern)
        with self.changed:
            self.changed.wait_for(lambda: self.ended or any(map(regex.search, self.lines)), timeout)
            match = next(filter(regex.search, self.lines), None)
        assert match, f"no line matching {pattern!r}:\n{self.text()[-5000:]}"
        return match

    def finish(self, timeout: float = 180) -> str:
        self.process.wait(timeout)
        self.reader.join(timeout)
        return self.text()

    def text(self) -> str:
        return "".join(self.lines)


def published_from(text: str) -> dict:
    lines = [line for line in text.splitlines() if line.startswith("PUBLISHED ")]
    assert lines, f"the run did not publish:\n{text[-5000:]}"
    return json.loads(lines[-1].removeprefix("PUBLISHED "))


def leftovers(target: Path) -> list[str]:
    """Staging folders and lock files of `target` still on disk."""
    return sorted(p.name for p in target.parent.glob(f".{target.name}.*"))


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def host_compile_cache() -> list[str]:
    """The compiled code in torch's host-wide cache, which a run must leave alone
    (compressflow.model.compile_cache); precompiled headers, whose folder a process that set
    its own cache after importing torch cannot move, are left out."""
    from compressflow import compat

    folder = Path(compat.shared_compile_cache_dir())
    found = folder.rglob("*") if folder.exists() else []
    return sorted(str(p) for p in found if "precompiled_headers" not in p.parts)


def kept_compiled() -> set[str]:
    """The compiled libraries in the kept compile cache (compressflow.model.compile_cache)."""
    from compressflow.model import compile_cache

    return {str(p) for p in compile_cache.kept_cache().rglob("*.so")}


def assert_compiled_code_kept(before: set[str]) -> None:
    """A run that compiled and ended well lost nothing from the kept cache and, when the cache
    started empty (a fresh clone: CI), added its libraries. From a warm cache it compiles
    nothing new (every kernel is a hit), so only the first half can be checked there."""
    after = kept_compiled()
    assert before <= after, f"the kept cache lost {sorted(before - after)}"
    assert after, "nothing compiled was kept"
