"""Benchmark: uploading a published folder to S3 through `compressflow.store.objects.commit_folder`
against s3fs's own `put` of the same files to the same server, and what a reuse check costs.

Writes a folder as publish leaves it (one shard of `--size-gb` random bytes, a few small files, a
manifest with the sha256 of each), starts moto's S3 server on loopback (`moto_server`, as the
tests do: a Python server, so this compares our client path with s3fs's, not with S3), then for
each of `--repeats` rounds uploads the folder to a fresh prefix, each variant in a fresh process
(imports and client set-up counted apart: the clock starts at the upload's call):

- `ours`: commit_folder (parts checked against their SHA-256, the object's composite checksum
  compared, the manifest last, the lease taken and released);
- `s3fs`: `S3FileSystem.put(folder, prefix, recursive=True)` (no checksum asked).

Reported: throughput medians side by side and their ratio (target: ours >= 0.9 x s3fs); the
peak RSS of our upload's process above its baseline before the upload, sampled every 5 ms (target:
at most 64 MB for a 2 GB shard); and a reuse check (commit_folder on a prefix already holding the
output intact) against a bare listing and manifest read (target: no more than 1.5 x, i.e. no
other request than those two).

s3fs is not a dependency of compressflow: install it into the virtualenv first
(`.venv/bin/python -m uv pip install --python .venv/bin/python s3fs`).

    python -m benchmarks.object_upload [--size-gb 2] [--repeats 3] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from benchmarks.common import free_port

BUCKET = "bench"
SMALL_FILES = {"config.json": 2_000, "tokenizer.json": 4_000_000, "recipe.yaml": 1_000}


def make_folder(folder: Path, size_gb: float) -> None:
    """A sealed output: one shard of random bytes, small files, a manifest of their sha256."""
    import numpy as np

    from compressflow.store.identity import file_digests

    folder.mkdir(parents=True)
    rng, left = np.random.default_rng(0), int(size_gb * (1 << 30))
    with (folder / "model.safetensors").open("wb") as out:
        while left:
            chunk = min(left, 64 << 20)
            out.write(rng.bytes(chunk))
            left -= chunk
    for name, size in SMALL_FILES.items():
        (folder / name).write_bytes(rng.bytes(size))
    names = ["model.safetensors", *SMALL_FILES]
    manifest = {
        "result": {"run_key": "bench"},
        "files": sorted([*names, "manifest.json"]),
        "file_sha256": file_digests(folder, names),
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))


class RssPeak(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.process, self.peak, self.done = psutil.Process(), 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.005):
            self.peak = max(self.peak, self.process.memory_info().rss)


def child(variant: str, folder: Path, uri: str) -> None:
    """One upload in this fresh process; prints seconds and RSS growth as JSON."""
    if variant == "ours":
        from compressflow.store.objects import commit_folder, open_store

        store = open_store(uri)
        store.list()  # the client's connection and credentials resolved, as for s3fs's below

        def upload():
            commit_folder(folder, store)
    else:
        import s3fs

        fs = s3fs.S3FileSystem(endpoint_url=os.environ["AWS_ENDPOINT_URL"])
        fs.ls(BUCKET)

        def upload():
            fs.put(str(folder), uri.removeprefix("s3://"), recursive=True)

    baseline = psutil.Process().memory_info().rss
    sampler = RssPeak()
    sampler.start()
    started = time.perf_counter()
    upload()
    seconds = time.perf_counter() - started
    sampler.done.set()
    sampler.join()
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {
                "seconds": seconds,
                "rss_growth_mb": (max(sampler.peak, baseline) - baseline) / 2**20,
                "baseline_mb": baseline / 2**20,
                "maxrss_mb": peak_kb / 1024,
            }
        )
    )


def run_child(variant: str, folder: Path, uri: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.object_upload", "--child", variant, str(folder), uri],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"{variant} failed:\n{done.stdout}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def reuse_cost(folder: Path, uri: str, repeats: int = 7) -> tuple[float, float]:
    """Median seconds of a reuse check, and of a bare listing and manifest read."""
    from compressflow.store.objects import commit_folder, open_store

    store = open_store(uri)
    reuse, bare = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        assert commit_folder(folder, store).reused
        reuse.append(time.perf_counter() - started)
        started = time.perf_counter()
        store.list()
        store.read("manifest.json", 1 << 24)
        bare.append(time.perf_counter() - started)
    return statistics.median(reuse), statistics.median(bare)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--child", nargs=3, metavar=("VARIANT", "FOLDER", "URI"))
    args = parser.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]), args.child[2])
        return 0
    # It writes a 2 GB folder and moto's log there: never into a folder holding anything else.
    if args.workdir and args.workdir.exists() and any(args.workdir.iterdir()):
        parser.error(f"--workdir {args.workdir} is not empty: name a new or empty folder")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="object-upload-"))
    folder, port = work / "published", free_port()
    make_folder(folder, args.size_gb)
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    log = (work / "moto.log").open("w")
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        import boto3

        client = boto3.client("s3")
        for _ in range(100):
            try:
                client.create_bucket(Bucket=BUCKET)
                break
            except Exception:
                time.sleep(0.2)
        size = sum(p.stat().st_size for p in folder.iterdir())
        figures: dict[str, list[dict]] = {"ours": [], "s3fs": []}
        for round_ in range(args.repeats):
            for variant in ("ours", "s3fs"):  # alternated, so load drifts hit both alike
                prefix = f"{variant}-{round_}"
                figures[variant].append(run_child(variant, folder, f"s3://{BUCKET}/{prefix}"))
                if variant == "s3fs" or round_ < args.repeats - 1:  # moto keeps objects in RAM
                    for item in client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]:
                        client.delete_object(Bucket=BUCKET, Key=item["Key"])
        reuse, bare = reuse_cost(folder, f"s3://{BUCKET}/ours-{args.repeats - 1}")
    finally:
        server.terminate()
        server.wait(10)
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    rate = {v: statistics.median(size / r["seconds"] / 1e6 for r in figures[v]) for v in figures}
    growth = max(r["rss_growth_mb"] for r in figures["ours"])
    s3fs_growth = max(r["rss_growth_mb"] for r in figures["s3fs"])
    ratio = rate["ours"] / rate["s3fs"]
    print(f"{size / 1e9:.2f} GB folder, {args.repeats} rounds, load {os.getloadavg()[0]:.1f}")
    print("| variant | MB/s (median) | each round MB/s | peak RSS above baseline MB (max) |")
    print("|---|---|---|---|")
    for variant, grew in (("ours", growth), ("s3fs", s3fs_growth)):
        each = ", ".join(f"{size / r['seconds'] / 1e6:.0f}" for r in figures[variant])
        print(f"| {variant} | {rate[variant]:.0f} | {each} | {grew:.1f} |")
    print(f"throughput ours / s3fs: {ratio:.2f} (target >= 0.9)")
    print(f"our peak RSS above baseline: {growth:.1f} MB (target <= 64)")
    print(
        f"reuse check {reuse * 1e3:.1f} ms, bare listing + manifest read {bare * 1e3:.1f} ms: "
        f"{reuse / bare:.2f} x (target <= 1.5)"
    )
    met = ratio >= 0.9 and growth <= 64 and reuse / bare <= 1.5
    print("targets met" if met else "a target missed")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
