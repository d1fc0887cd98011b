"""What a result depends on: every key and fingerprint compressflow computes, in one place.

A cache bug means reading this module. Each key hashes what decides its result, and nothing else:

- `run_key`: a published checkpoint (model identity, dataset fingerprint, rendered recipe, the
  calibration knobs that change weights, library versions). A later run with the same key finds
  the published folder and returns it without calibrating (`store.output.find_published`).
- `cache_key`: a cached stage's result (Prefect's inputs and task source, `code_identity()`, and
  the stat signature of every local path among the inputs: a folder edited in place keeps its
  path) (`store.caching.LocalSourceAware`).
- `recipe_sha256`: a rendered recipe (its YAML text; the recipe engine and the target strategies
  set it on every recipe they make), part of `run_key`.
- `resume_key`: a calibration checkpoint (what calibration reads, the code that runs it)
  (`calibration.resume`).
- `code_identity`: every .py file of the installed package and the libraries' versions. What a
  stage returns depends on the code it calls and the libraries that do the work: editing or
  upgrading any of them misses the caches instead of reusing what the new code would not produce.
- `stat_signature` (cheap: path, size, mtime, ctime, inode), `content_hash` (a local model
  folder's bytes), `dataset_fingerprint` (the tokens a calibration reads) and
  `tokenizer_identity` (what decides those tokens, part of the fingerprint): the identities of
  files and data.

Imports only the shared vocabulary: every other module that needs a key imports this one.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from compressflow.params import CalibrationArgs, OutputArgs, RecipeArgs, TargetArgs
from compressflow.results import BuiltDataset, FetchedModel, Point, RenderedRecipe

# The libraries whose versions a result depends on: recorded in the manifest, part of the run key,
# of the cache key of the cached stages and of the resume key.
LIBRARIES = (
    "llmcompressor",
    "compressed-tensors",
    "transformers",
    "tokenizers",
    "torch",
    "datasets",
    "prefect",
)
# The installed package's parts (flows, tasks and blocks are mapped from top-level folders).
PACKAGES = ("compressflow", "compressflow.flows", "compressflow.tasks", "compressflow.blocks")
# The layout of a calibration checkpoint's files (calibration.resume): bumped when it changes.
RESUME_FORMAT = 1


# ---------------------------------------------------------------- code and libraries


def library_versions() -> dict[str, str]:
    """Installed versions of `LIBRARIES`, read from their metadata (nothing is imported)."""
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


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
    """The code and library versions a result came from; computed once per process (a worker
    runs one version of both)."""
    versions = json.dumps(library_versions(), sort_keys=True)
    return hashlib.sha256(f"{source_hash(package_folders())}\n{versions}".encode()).hexdigest()


# ---------------------------------------------------------------- files and data


def _files(path: Path) -> list[Path]:
    """Every file under the folder `path`, in name order: what its identities cover."""
    return sorted(p for p in path.rglob("*") if p.is_file())


def stat_signature(path: Path) -> str | None:
    """Hash of (relative path, size, mtime, ctime, inode) of every file under `path`; None if it
    isn't local.

    Stat, not content: it must stay cheap on a 100 GB model folder. Size and mtime alone miss a
    file rewritten with its old mtime (`cp -p`, `rsync -a`, image builds that pin every mtime):
    a write or a replacement also sets ctime or a new inode, which no tool sets back.
    """
    if not path.exists():
        return None
    digest = hashlib.sha256()
    for file in [path] if path.is_file() else _files(path):
        digest.update(f"{file.relative_to(path.parent)}:{_stat(file)}\n".encode())
    return digest.hexdigest()


def _stat(file: Path) -> str:
    s = file.stat()
    return f"{s.st_size}:{s.st_mtime_ns}:{s.st_ctime_ns}:{s.st_ino}"


def file_stats(path: Path) -> dict[str, str]:
    """Each file under the folder `path` -> its size, mtime, ctime and inode (`stat_signature`'s
    parts, by file): what `changed_since` holds a folder to later."""
    return {str(file.relative_to(path)): _stat(file) for file in _files(path)}


def changed_since(path: Path, stats: dict[str, str]) -> list[str]:
    """The files of `stats` that are gone from `path`, or were written or replaced since. Files
    added are not counted: a hub snapshot folder is shared, and another run may download into it
    files this one never reads."""
    changed = []
    for name, then in sorted(stats.items()):
        try:
            now = _stat(path / name)
        except OSError:  # removed, or a link that no longer leads anywhere
            now = None
        if now != then:
            changed.append(name)
    return changed


CHUNK_BYTES = 1 << 20  # between two looks at `stop`: a millisecond of hashing
_HASH_THREADS = min(8, os.cpu_count() or 1)


class Stopped(Exception):
    """A hash stopped before its end: nobody wants it any more."""


def file_sha256(file: Path, stop: threading.Event | None = None) -> bytes:
    """sha256 of one file's bytes, read in chunks; raises Stopped once `stop` is set."""
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with file.open("rb", buffering=0) as handle:
        while read := handle.readinto(buffer):
            if stop is not None and stop.is_set():
                raise Stopped(file)
            digest.update(view[:read])  # releases the GIL: other threads hash beside it
    return digest.digest()


def content_hash(path: Path) -> str:
    """sha256 over every file's relative path and content: the identity of a local folder.

    Files are hashed on several threads (hashlib and reads release the GIL): one core hashes
    about 1.5 GB/s, so a 800 GB checkpoint would spend 9 minutes here before any check. A hash
    started early (`hashing_early`) is taken instead where the files are still the ones it read.
    """
    early = EARLY_HASHES.pop(path.resolve(), None)
    if early is not None and (digest := early.result()) is not None:
        if stat_signature(path) == early.signature:
            return digest
    return hash_folder(path, _HASH_THREADS)


def hash_folder(path: Path, threads: int, stop: threading.Event | None = None) -> str:
    """`content_hash`'s work; with `stop`, on threads that yield the CPU to everything else."""
    files = _files(path)
    digest = hashlib.sha256()
    for file, file_digest in zip(files, _sha256s(files, threads, stop), strict=True):
        digest.update(str(file.relative_to(path)).encode() + b"\0")
        digest.update(file_digest)
    return digest.hexdigest()


def file_digests(folder: Path, names: list[str]) -> dict[str, str]:
    """sha256 (hex) of each named file under `folder`, hashed on several threads: what a
    published folder's manifest records of its files, and checks them against before a reuse."""
    digests = _sha256s([folder / name for name in names], _HASH_THREADS)
    return {name: digest.hex() for name, digest in zip(names, digests, strict=True)}


def _sha256s(files: list[Path], threads: int, stop: threading.Event | None = None) -> list[bytes]:
    with ThreadPoolExecutor(threads, initializer=_yielding if stop else None) as pool:
        return list(pool.map(lambda file: file_sha256(file, stop), files))


def _yielding() -> None:
    """Lower this thread's priority (nice 10; on Linux a thread's own): an early hash takes the
    CPU the work it overlaps leaves, and never slows that work down."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (OSError, AttributeError):  # not Linux: the threads keep the process's priority
        pass


class _EarlyHash(threading.Thread):
    """`content_hash` of a folder on a thread of its own; its digest counts only if the files
    were the same before it read them and after (`signature`)."""

    def __init__(self, path: Path, threads: int):
        super().__init__(name=f"content hash of {path}", daemon=True)
        self.path, self.threads, self.stop = path, threads, threading.Event()
        self.signature: str | None = None
        self.digest: str | None = None

    def run(self) -> None:
        try:
            self.signature = stat_signature(self.path)
            digest = hash_folder(self.path, self.threads, self.stop)
            if stat_signature(self.path) == self.signature:
                self.digest = digest
        except (Stopped, OSError):  # not wanted, or unreadable: content_hash hashes it itself
            pass

    def result(self) -> str | None:
        self.join()
        return self.digest


# Early hashes by resolved folder: started by `hashing_early`, taken by `content_hash`.
EARLY_HASHES: dict[Path, _EarlyHash] = {}


@contextmanager
def hashing_early(path: Path | None) -> Iterator[None]:
    """Hash the local model folder `path` on low-priority threads while the block runs: the
    flow's first stages wait seconds for the forkserver's imports, and fetch then finds the hash
    (seconds per GB) done. What fetch has not taken is stopped at the block's end, so a refusal
    before fetch reads at most a chunk more. None: nothing to hash."""
    if path is None:
        yield
        return
    key = path.resolve()
    early = _EarlyHash(key, _HASH_THREADS)
    EARLY_HASHES[key] = early
    early.start()
    try:
        yield
    finally:
        early.stop.set()
        early.join()
        if EARLY_HASHES.get(key) is early:
            del EARLY_HASHES[key]


def dataset_fingerprint(tokenized, tokenizer_id: str, max_seq_len: int) -> str:
    """sha256 over every column (tokens, masks, processor tensors) and how they were made."""
    import numpy as np

    digest = hashlib.sha256(f"{tokenizer_id}\nmax_seq_len={max_seq_len}\n".encode())
    for batch in tokenized.with_format("numpy").iter(batch_size=256):
        for column in sorted(batch):
            for value in batch[column]:
                array = np.asarray(value)
                digest.update(f"{column}:{array.shape}:{array.dtype}\n".encode())
                digest.update(array.tobytes())
    return digest.hexdigest()


def tokenizer_identity(tokenizer) -> str:
    """Hash of the vocabulary, merges, normalizer and chat template: what decides the tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        vocab = backend.to_str()
    else:  # slow tokenizer
        vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
    template = str(getattr(tokenizer, "chat_template", None))
    text = "\n".join([type(tokenizer).__name__, vocab, template])
    return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------- keys


def recipe_sha256(text: str) -> str:
    """A rendered recipe's identity (`RenderedRecipe.sha256`, part of `run_key`): its YAML text."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def run_key(
    model: FetchedModel,
    dataset: BuiltDataset | None,
    recipe: RenderedRecipe,
    recipe_args: RecipeArgs,
    output: OutputArgs,
    calibration: CalibrationArgs,
    target: TargetArgs | None = None,
) -> str:
    """Hash of everything that determines the compressed checkpoint.

    Of the calibration knobs, the path and the batch size change the result (model_free rounds
    weights without oneshot; batches truncate to their shortest sample); where weights live and
    prefetching do not. A quality target decides which modules stay unquantized: it is part of
    the key when set, and absent otherwise (keys of runs without one are unchanged).
    """
    parts = {
        "model": model.identity,
        "model_class": model.model_class,
        "dataset": dataset.fingerprint if dataset else None,
        "recipe": recipe.sha256,
        "pipeline": recipe_args.pipeline,
        "sequential_targets": recipe_args.sequential_targets,
        "tracing_ignore": recipe_args.tracing_ignore,
        "save_compressed": output.save_compressed,
        "calibration": calibration.model_dump(
            include={"path", "batch_size", "moe_calibrate_all_experts"}
        ),
        "libraries": library_versions(),
    }
    if target is not None and target.wanted():
        parts["target"] = target.model_dump()
        # The held-out text picks the winning round: a local file edited in place must not
        # reuse what the old text chose (hub datasets are pinned by name and split).
        if name := target.held_out.dataset_name:
            parts["held_out_files"] = stat_signature(Path(name).expanduser())
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def cache_key(base: str, inputs: dict[str, Any], stores: tuple[str, ...] = ()) -> str:
    """A cached stage's key: Prefect's `base` (inputs and task source), `code_identity()`, the
    stat signature of every local path among the inputs, and `stores`: the `store_listing_key`
    of each store prefix among them."""
    signatures = [sig for path in local_paths(inputs) if (sig := stat_signature(path)) is not None]
    parts = [base, code_identity(), *signatures, *stores]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def store_listing_key(uri: str, listing: dict[str, tuple[int, str]]) -> str:
    """A prefix in object storage as one listing found it: its URI and each object's name, size
    and etag (an etag changes whenever an object is written again). It names the worker's
    download of a store model (compressflow.store.sources) and enters the fetch's cache key, so
    a prefix written since downloads again and a cached fetch of it is not reused."""
    lines = [uri, *(f"{name}:{size}:{etag}" for name, (size, etag) in sorted(listing.items()))]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def local_paths(inputs: dict[str, Any]) -> list[Path]:
    """Every input string that could name a local file or folder. Not "": an unset field would
    be the working directory, whose every edit would then miss the cache (and stat a checkout)."""
    return [
        Path(text).expanduser()
        for text in sorted(set(_strings(inputs)))
        if text and "\n" not in text and len(text) < 4096
    ]


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


def calibration_resume_key(
    model: FetchedModel,
    dataset: BuiltDataset,
    recipe: RenderedRecipe,
    oneshot_kwargs: dict[str, Any],
    device: str,
) -> dict:
    """A calibration checkpoint's key: what the calibration reads and how oneshot is called.

    Not the thread count: a child's share changes with the host's load, during a run too
    (compressflow.model.cpus), and a crashed run on a busy host would otherwise start over.
    Threads change only the order of float sums, as a share change mid-run already does."""
    arguments = {
        name: value if isinstance(value, (str, int, float, bool, list, type(None))) else repr(value)
        for name, value in oneshot_kwargs.items()
        if name not in ("dataset", "data_collator")
    }
    return resume_key(
        model=model.identity,
        model_class=model.model_class,
        dataset=dataset.fingerprint,
        recipe=recipe.sha256,
        oneshot=arguments,
        data_collator=getattr(oneshot_kwargs.get("data_collator"), "__qualname__", None),
        device=device,
    )


def resume_key(**parts) -> dict:
    """A calibration checkpoint's key: `parts` (what the calibration reads) plus the code that
    runs it and the checkpoint's file layout."""
    return {
        **parts,
        "format": RESUME_FORMAT,
        "libraries": library_versions(),
        "compressflow": code_identity(),
    }


def folder_signature(folder: Path) -> list[str]:
    """(relative name, size, mtime) of every file under `folder`: cheap on a large model, and
    any change to a file in place changes one of them."""
    signature = []
    for path in sorted(path for path in folder.rglob("*") if path.is_file()):
        stat = path.stat()
        signature.append(f"{path.relative_to(folder)}:{stat.st_size}:{stat.st_mtime_ns}")
    return signature


def vllm_score_key(
    base: Path, prompts: list[list[int]], trust_remote_code: bool, python: Path, vllm: list
) -> str:
    """A base model's cached vLLM score (`model.serving`): the base's files, the prompts, and
    the vLLM (`python`'s, at version `vllm`) that scored them."""
    identity = {
        "base": str(base),
        "files": folder_signature(base),
        "prompts": prompts,
        "trust_remote_code": trust_remote_code,
        "python": str(python),
        "vllm": vllm,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def point_key(point: Point) -> str:
    """A sweep point's output folder name (`point-<key>`): a rerun of the same point publishes
    into, and so reuses, the same folder."""
    return hashlib.sha256(point.model_dump_json().encode()).hexdigest()[:10]
