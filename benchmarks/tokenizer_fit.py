"""Benchmark: the folder check "tokenizer fits" (compressflow/model/folder_checks/vocab.py) on
tokenizers the size of real ones, written once under a temporary folder:

    qwen2.5   151,643 vocabulary entries, 151,387 merges, 22 added tokens (7 MB, as Qwen2.5's)
    gemma3    262,144 entries, 514,906 merges (about 30 MB, as Gemma 3's, past the 16 MiB cap
              on other JSON files)

Each is checked `--repeats` times in this process (config rows, no weights); the median is
printed beside json's and orjson's parse of the same file alone. Target: a 150k vocabulary well
under a second (issue 55).

    python -m benchmarks.tokenizer_fit [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

SIZES = {"qwen2.5": (151_643, 151_387, 22), "gemma3": (262_144, 514_906, 64)}


def write(folder: Path, vocab: int, merges: int, added: int) -> dict:
    """A BPE tokenizer.json of these sizes and the config.json its rows come from."""
    folder.mkdir(parents=True, exist_ok=True)
    words = [f"\u0120w{i:06d}x" for i in range(vocab)]
    tokens = [
        {"id": vocab + k, "content": f"<|extra_{k}|>", "special": True, "normalized": False}
        for k in range(added)
    ]
    document = {
        "version": "1.0",
        "added_tokens": tokens,
        "model": {
            "type": "BPE",
            "vocab": {word: i for i, word in enumerate(words)},
            "merges": [[words[i % vocab][:3], words[i % vocab][3:]] for i in range(merges)],
        },
    }
    (folder / "tokenizer.json").write_text(json.dumps(document, ensure_ascii=False))
    return {"model_type": "qwen2", "vocab_size": vocab + added + 64, "eos_token_id": vocab}


def median_seconds(repeats: int, call, *args) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call(*args)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    import orjson

    from compressflow.model.folder_checks.vocab import fit

    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        for name, sizes in SIZES.items():
            folder = Path(root) / name
            config = write(folder, *sizes)
            data = (folder / "tokenizer.json").read_bytes()
            found = fit(folder, config, headers=False)
            assert found.problem is None, found.problem
            check = median_seconds(args.repeats, fit, folder, config, False)
            parse = median_seconds(args.repeats, json.loads, data)
            fast = median_seconds(args.repeats, orjson.loads, data)
            print(
                f"{name}: {len(data) / 1e6:.1f} MB, check {check:.3f} s; "
                f"json.loads {parse:.3f} s, orjson.loads {fast:.3f} s"
            )


if __name__ == "__main__":
    main()
