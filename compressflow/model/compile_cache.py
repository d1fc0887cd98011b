"""torch.compile caches our processes can use without trusting one another's.

torch compiles into one folder per host by default (`/tmp/torchinductor_<user>`), shared by
every process there; one killed while it compiles leaves a truncated library that fails every
later compile on the host. So a process of ours that compiles (vLLM's sampler in a serving
check, AutoRound in a calibration) gets a folder of its own (TORCHINDUCTOR_CACHE_DIR), seeded
from compressflow's kept cache, and only a process that ended well has its new files merged back,
each copied whole and then renamed: the kept cache holds whole files of finished processes, and
a seeded process starts warm (a tiny model's vLLM check: 18 s, against 30 s with an empty cache).

A file missing from the kept cache is only a cache miss (torch compiles it again), so the cache
is trimmed oldest first past KEPT_BYTES. Trimming removes files, so it works only in a folder
this module made (its MARK file), and never through a link: a COMPRESSFLOW_COMPILE_CACHE_DIR
pointed at a folder of the user's is left alone, with a warning.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from compressflow.settings import cache_root, settings

FOLDER = "torch-compile"  # under settings().cache_dir, unless compile_cache_dir is set
KEPT_BYTES = 512 << 20
# torch's lock files: empty, and held by whichever process compiles.
SKIPPED = {"locks"}
PARTIAL = ".partial"  # a file being merged; one a killed merge left is removed after an hour
MARK = ".compressflow-compile-cache"  # in a kept cache this module made


def kept_cache() -> Path:
    """$COMPRESSFLOW_COMPILE_CACHE_DIR, else the cache dir's `torch-compile/`."""
    configured = settings().compile_cache_dir
    return configured.expanduser() if configured else cache_root() / FOLDER


def _files(folder: Path) -> dict[Path, os.stat_result]:
    """Every file under `folder` but the locks and the mark, by relative path (none when it is
    missing); links, and what lies behind them, are not listed."""
    found = {}
    for parent, folders, names in os.walk(folder):  # walk does not follow links to folders
        here = Path(parent)
        folders[:] = [name for name in folders if here != folder or name not in SKIPPED]
        for name in names:
            path = here / name
            if path == folder / MARK or path.is_symlink():
                continue
            try:
                found[path.relative_to(folder)] = path.stat()
            except FileNotFoundError:  # trimmed meanwhile by another process
                continue
    return found


def _ours(kept: Path) -> bool:
    """Whether `kept` is a kept cache this module made; a missing or empty folder becomes one."""
    if (kept / MARK).is_file():
        return True
    if kept.is_symlink() or (kept.exists() and (not kept.is_dir() or any(kept.iterdir()))):
        return False
    kept.mkdir(parents=True, exist_ok=True)
    (kept / MARK).touch()
    return True


def seed(private: Path) -> Path:
    """Copy the kept cache into `private` and return it; what it has already is left as it is
    (the ranks of one calibration seed one folder). Nothing is copied when the kept cache is
    missing or cannot be read: the process then compiles from scratch."""
    private.mkdir(parents=True, exist_ok=True)
    kept = kept_cache()
    try:
        for relative in _files(kept) if (kept / MARK).is_file() else ():
            if not relative.name.endswith(PARTIAL) and not (private / relative).exists():
                _copy_whole(kept / relative, private / relative)
    except OSError as exc:
        logging.getLogger(__name__).warning("Compiling without the kept cache %s: %s", kept, exc)
    return private


def _copy_whole(source: Path, target: Path) -> None:
    """Copy beside `target`, then rename over it: a reader never sees half of the file. A
    source removed meanwhile (trimmed by another process) is a cache miss, not an error."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}{PARTIAL}")
    try:
        shutil.copy(source, partial)  # mode (a library runs) and a fresh mtime
    except FileNotFoundError:
        return
    os.replace(partial, target)


def keep(private: Path) -> None:
    """Merge what a process that ended well compiled into `private` back into the kept cache.

    Called only then: a killed process's files may be truncated. Each new file is copied beside
    its place and renamed over it, so a reader never sees half of one.
    """
    kept = kept_cache()
    try:
        if not _ours(kept):
            logging.getLogger(__name__).warning(
                "Not keeping compiled code in %s: it holds files compressflow did not write, and "
                "keeping trims the oldest; point COMPRESSFLOW_COMPILE_CACHE_DIR at an empty or "
                "new folder",
                kept,
            )
            return
        present = _files(kept)
        for relative, stat in _files(private).items():
            known = relative in present and present[relative].st_size == stat.st_size
            if known or relative.name.endswith(PARTIAL):
                continue
            _copy_whole(private / relative, kept / relative)
        trim(kept)
    except OSError as exc:  # a cache not kept costs the next process its compile, not this run
        logging.getLogger(__name__).warning("Could not keep compiled code in %s: %s", kept, exc)


def trim(kept: Path) -> None:
    """Remove the oldest files until the kept cache holds at most KEPT_BYTES, and what killed
    merges left."""
    files = sorted(_files(kept).items(), key=lambda item: item[1].st_mtime, reverse=True)
    total, hour_ago = 0, time.time() - 3600
    for relative, stat in files:
        total += stat.st_size
        stale = relative.name.endswith(PARTIAL) and stat.st_mtime < hour_ago
        if total > KEPT_BYTES or stale:
            (kept / relative).unlink(missing_ok=True)
