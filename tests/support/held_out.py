"""Held-out code for lm-eval's project tasks, cut as the yardstick cuts it, without building it."""

from __future__ import annotations

import inspect
import json
import json.decoder
from pathlib import Path


def code_held_out(folder: Path, texts: int = 12) -> Path:
    """A JSON-lines file of {"text": ...} rows: 9-line windows of a standard-library module the
    tiny model's tokenizer was not trained on, each ending in a cut line as token windows do."""
    lines = inspect.getsource(json.decoder).splitlines()
    windows = ["\n".join(lines[i : i + 9]) + "\n    xy" for i in range(0, 9 * texts, 9)]
    path = folder / "held_out.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in windows))
    return path
