"""Benchmark: what verifying a checkpoint costs against calibrating it.

Runs the compress-model flow on a random-weight Llama big enough that calibration takes tens of
seconds on 2 CPU cores (6 layers, 768 wide), one fresh process per run so each peak RSS is that
run's own, and reads from the run's manifest:

- calibration: oneshot's seconds (the calibrate stage's own measure);
- verification: capturing the base model's reference logits (inside calibrate, before oneshot)
  plus the verify stage (reload from disk, config, names, logits);
- peak RSS after calibrate (weights loaded, calibrated, saved) and after verify (reloaded);
- the vLLM check (serving the output and the base in vLLM, in verify), when the vLLM environment
  is built (`make vllm-env`), reported apart from the checks above.

    python -m benchmarks.verify_cost [--repeats 3] [--samples 64] [--max-seq-len 256]

Targets: verification without vLLM <= 10% of calibration time (issue "Never publish a broken
model"), the vLLM check <= 25% of it at the benchmark size, 96 x 512 tokens (issue "Proven where
it will run"), and verify raises the process's peak RSS by nothing (<= 1.02x, allowing for page
noise). Medians; exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TARGET_TIME_RATIO = 0.10
TARGET_RSS_RATIO = 1.02
TARGET_VLLM_RATIO = 0.25


def one_run(root: Path, preset: str, samples: int, max_seq_len: int, out: Path) -> None:
    """In a child process: compress once and print the figures as JSON."""
    os.environ.update(
        PREFECT_HOME=str(root / "prefect"),
        CLEARML_OFFLINE_MODE="1",
        CLEARML_CACHE_DIR=str(root / "clearml"),
        COMPRESSFLOW_CACHE_DIR=str(root / "cache"),
        COMPRESSFLOW_TRACKING="0",
        HF_HUB_OFFLINE="1",
        PREFECT_LOGGING_LEVEL="WARNING",
    )
    from prefect.testing.utilities import prefect_test_harness

    from benchmarks.flow_vs_bare import model_spec
    from compressflow.demo.assets import build_tiny_llama
    from compressflow.flows.compress import compress

    model = build_tiny_llama(root / "model", model_spec())
    with prefect_test_harness(server_startup_timeout=120):
        published = compress(
            model={"model_id": str(model)},
            dataset={"text_samples": samples, "max_seq_len": max_seq_len},
            recipe={"preset": preset},
            output={"save_directory": str(out)},
        )
    manifest = json.loads(Path(published.path, "manifest.json").read_text())
    stages = {s.name: s.seconds for s in published.stages}
    served = manifest["verification"]["vllm"]
    vllm_s = served["seconds"] if served and served["outcome"] == "served" else 0.0
    figures = {
        "oneshot_s": manifest["calibration_seconds"],
        "reference_s": manifest["reference_seconds"],
        "verify_s": stages["verify"] - vllm_s,
        "vllm_s": vllm_s,
        "rss_calibrate_mb": manifest["peak_rss_mb"],
        "rss_verify_mb": manifest["verification"]["peak_rss_mb"],
    }
    print("FIGURES " + json.dumps(figures))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--presets", default="W4A16,W8A8")
    parser.add_argument("--one", nargs=2, metavar=("ROOT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one_run(Path(args.one[0]), args.presets, args.samples, args.max_seq_len, Path(args.one[1]))
        return 0

    root = Path(tempfile.mkdtemp(prefix="verify-cost-"))
    failed = False
    for preset in args.presets.split(","):
        rows = []
        for repeat in range(args.repeats):
            child = [sys.executable, "-m", "benchmarks.verify_cost", "--presets", preset]
            child += ["--samples", str(args.samples), "--max-seq-len", str(args.max_seq_len)]
            child += ["--one", str(root), str(root / "out" / f"{preset}-{repeat}")]
            done = subprocess.run(child, capture_output=True, text=True, check=True)
            line = next(x for x in done.stdout.splitlines() if x.startswith("FIGURES "))
            rows.append(json.loads(line.removeprefix("FIGURES ")))
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        time_ratio = statistics.median(
            (r["reference_s"] + r["verify_s"]) / r["oneshot_s"] for r in rows
        )
        rss_ratio = statistics.median(r["rss_verify_mb"] / r["rss_calibrate_mb"] for r in rows)
        vllm_ratio = statistics.median(r["vllm_s"] / r["oneshot_s"] for r in rows)
        ok = time_ratio <= TARGET_TIME_RATIO and rss_ratio <= TARGET_RSS_RATIO
        vllm_ok = vllm_ratio <= TARGET_VLLM_RATIO
        failed |= not ok or not vllm_ok
        print(
            f"{preset}: oneshot {med['oneshot_s']:.1f} s, reference {med['reference_s']:.2f} s, "
            f"verify {med['verify_s']:.2f} s -> verification/calibration {time_ratio:.3f} "
            f"(target <= {TARGET_TIME_RATIO}); peak RSS after calibrate "
            f"{med['rss_calibrate_mb']:.0f} MB, after verify {med['rss_verify_mb']:.0f} MB -> "
            f"{rss_ratio:.3f} (target <= {TARGET_RSS_RATIO}) [{'met' if ok else 'MISSED'}; "
            f"median of {len(rows)} fresh processes]"
        )
        print(
            f"{preset}: vLLM check {med['vllm_s']:.1f} s -> vLLM/calibration {vllm_ratio:.3f} "
            f"(target <= {TARGET_VLLM_RATIO}) [{'met' if vllm_ok else 'MISSED'}]"
            if med["vllm_s"]
            else f"{preset}: vLLM check not run (no vLLM environment: make vllm-env)"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
