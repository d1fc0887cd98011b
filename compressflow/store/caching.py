"""Cache policy for the stages worth reusing across runs: model fetch and dataset build.

Prefect's DEFAULT policy keys on the run id, so nothing is reused between runs. Keying on inputs
alone is wrong the other way for local sources: a model folder or data file edited in place keeps
its path. `LocalSourceAware` therefore keys on the inputs, the task's source and a cheap stat
signature (path, size, mtime) of every local path found among the inputs. The stage itself then
records a content identity (a hash), so a cache hit is still traceable in the manifest.

The task's own source is not enough: what a stage returns also depends on the code it calls (the
recipe engine, the dataset builder, the result models it pickles) and on the libraries that do
the work. So the key also holds `code_identity()`: a hash of every .py file of the installed
compressflow package and the versions of the libraries the manifest records
(`manifest.LIBRARIES`). Editing or upgrading any of them misses the cache instead of reusing, for
up to 7 days, a result the new code would not produce (or a result model missing a field added
since).

Cached results point at folders on disk; the flow's stage runner refreshes an entry whose folder
was deleted, so a cleaned cache never surfaces as a confusing error downstream.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from prefect.cache_policies import INPUTS, TASK_SOURCE, CachePolicy
from prefect.context import TaskRunContext
from pydantic import BaseModel

from compressflow.settings import settings
from compressflow.store.manifest import library_versions

# The installed package's parts (flows, tasks and blocks are mapped from top-level folders).
PACKAGES = ("compressflow", "compressflow.flows", "compressflow.tasks", "compressflow.blocks")

# Unpinned hub revisions ("main") are re-resolved after this long; pinned ones never change.
CACHE_EXPIRATION = timedelta(days=7)


def package_folders() -> list[Path]:
    """The folders of `PACKAGES`, found without importing them; a folder already inside an
    earlier one (a non-editable install nests them) is not listed twice."""
    folders: list[Path] = []
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        for location in (spec.submodule_search_locations or []) if spec else []:
            folder = Path(location).resolve()
            if not any(folder.is_relative_to(seen) for seen in folders):
                folders.append(folder)
    return folders


def source_hash(folders: list[Path]) -> str:
    """sha256 over every .py file's path (relative to its folder) and content."""
    digest = hashlib.sha256()
    for folder in folders:
        for file in sorted(folder.rglob("*.py")):
            digest.update(f"{folder.name}/{file.relative_to(folder)}\0".encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()


@functools.cache
def code_identity() -> str:
    """The code and library versions a cached result came from; computed once per process
    (a worker runs one version of both)."""
    versions = json.dumps(library_versions(), sort_keys=True)
    return hashlib.sha256(f"{source_hash(package_folders())}\n{versions}".encode()).hexdigest()


def _strings(value: Any):
    """Every string inside plain data and pydantic models, which is where paths hide."""
    if isinstance(value, BaseModel):
        value = value.model_dump()
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def stat_signature(path: Path) -> str | None:
    """Hash of (relative path, size, mtime) of every file under `path`; None if it isn't local.

    Stat, not content: it must stay cheap on a 100 GB model folder, and any in-place edit
    changes size or mtime.
    """
    if not path.exists():
        return None
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    digest = hashlib.sha256()
    for file in files:
        stat = file.stat()
        digest.update(
            f"{file.relative_to(path.parent)}:{stat.st_size}:{stat.st_mtime_ns}\n".encode()
        )
    return digest.hexdigest()


@dataclass
class LocalSourceAware(CachePolicy):
    """INPUTS + TASK_SOURCE + `code_identity()`, plus the stat signature of local paths among
    the inputs. No fields: Prefect pickles the policy, and the identity is per process."""

    def compute_key(
        self,
        task_ctx: TaskRunContext,
        inputs: dict[str, Any],
        flow_parameters: dict[str, Any],
        **kwargs: Any,
    ) -> str | None:
        base = (INPUTS + TASK_SOURCE).compute_key(task_ctx, inputs, flow_parameters, **kwargs)
        if base is None:
            return None
        signatures = [
            sig for path in local_paths(inputs) if (sig := stat_signature(path)) is not None
        ]
        return hashlib.sha256("\n".join([base, code_identity(), *signatures]).encode()).hexdigest()


def local_paths(inputs: dict[str, Any]) -> list[Path]:
    """Every input string that could name a local file or folder. Not "": an unset field would
    be the working directory, whose every edit would then miss the cache (and stat a checkout)."""
    return [
        Path(text).expanduser()
        for text in sorted(set(_strings(inputs)))
        if text and "\n" not in text and len(text) < 4096
    ]


def cache_root() -> Path:
    """Where compressflow keeps built datasets: $COMPRESSFLOW_CACHE_DIR or ~/.cache/compressflow."""
    return settings().cache_dir.expanduser()
