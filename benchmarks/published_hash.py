"""Benchmark: what checking a published folder's files costs (publish hashes them once; a run
that would reuse the folder, and an evaluation that records its results there, hash them again).

Writes a folder of shards of random bytes, as large as a published output of the size asked,
then times `store.manifest.changed_files` on it (every file hashed on compressflow's threads, the
manifest's list and hashes compared) against reading the same bytes once without hashing. Page
cache warm, as after the calibration that wrote them; medians of `--repeats`.

    python -m benchmarks.published_hash [--gb 2] [--repeats 3] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from compressflow.store.identity import file_digests
from compressflow.store.manifest import (
    MANIFEST,
    Manifest,
    ManifestResult,
    changed_files,
    write_manifest,
)

SHARD_BYTES = 512 << 20
# Published sizes of W4A16 outputs (4-bit weights, group scales, 16-bit embeddings and head),
# from the 1B, 8B and 70B shapes' parameter counts.
OUTPUTS_GB = {"1B": 1.0, "8B": 5.7, "70B": 40.0}


def build(folder: Path, gb: float) -> list[str]:
    names, left = [], int(gb * (1 << 30))
    while left > 0:
        name = f"model-{len(names) + 1:05d}.safetensors"
        size = min(SHARD_BYTES, left)
        with open(folder / name, "wb") as handle:
            for _ in range(0, size, 1 << 24):
                handle.write(os.urandom(min(1 << 24, size)))
        names.append(name)
        left -= size
    return names


def manifest_of(folder: Path, names: list[str]) -> Manifest:
    result = ManifestResult(
        run_key="k",
        model_identity="x",
        scheme="W4A16",
        size_bytes=1,
        original_size_bytes=1,
        compression_ratio=1.0,
    )
    return Manifest(
        created_at="2026-11-29T00:00:00+00:00",
        result=result,
        inputs={},
        model={},
        dataset=None,
        recipe={},
        libraries={},
        stages=[],
        peak_rss_mb=0.0,
        files=[*names, MANIFEST],
        file_sha256=file_digests(folder, names),
    )


def read_only(folder: Path, names: list[str]) -> None:
    buffer = bytearray(1 << 20)
    for name in names:
        with open(folder / name, "rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass


def timed(call, repeats: int) -> float:
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default="")
    options = parser.parse_args()
    root = Path(options.workdir or tempfile.mkdtemp(prefix="published-hash-"))
    folder = root / "out"
    folder.mkdir(parents=True)  # refuses a folder already there: only what this made is removed
    try:
        names = build(folder, options.gb)
        manifest = manifest_of(folder, names)  # also the first read: the cache is warm after
        write_manifest(folder, manifest)
        assert changed_files(folder, manifest) == []
        read = timed(lambda: read_only(folder, names), options.repeats)
        check = timed(lambda: changed_files(folder, manifest), options.repeats)
    finally:
        shutil.rmtree(folder if options.workdir else root, ignore_errors=True)
    per_gb = check / options.gb
    print(f"{options.gb:g} GB in {len(names)} files, {os.cpu_count()} CPUs")
    print(f"  read once, no hash:   {read:.2f} s ({options.gb / read:.2f} GB/s)")
    print(
        f"  changed_files (hash): {check:.2f} s ({options.gb / check:.2f} GB/s), x{check / read:.1f}"
    )
    for shape, gb in OUTPUTS_GB.items():
        print(f"  a {shape} W4A16 output ({gb:g} GB): about {per_gb * gb:.1f} s per check here")


if __name__ == "__main__":
    main()
