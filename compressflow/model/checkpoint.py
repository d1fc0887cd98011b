"""What a safetensors checkpoint holds, from its headers alone: no weight is read.

Fetch counts parameters with it, the memory plan finds the modules model_free_ptq must be told
to leave alone, and verify compares saved names with the source's and finds each source tensor's
shard.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    file: Path
    dtype: str = ""  # safetensors' name for it: BF16, F8_E4M3, ...


def read_header(file: Path) -> tuple[int, dict] | None:
    """(header length, header) of a safetensors file, read as JSON: safetensors' own reader
    imports torch, which the flow's process does not. None when the header is unreadable."""
    size = file.stat().st_size
    with file.open("rb") as handle:
        prefix = handle.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        header = handle.read(length) if 0 <= length <= size - 8 else b""
    try:
        tensors = json.loads(header) if header else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return (length, tensors) if isinstance(tensors, dict) else None


def tensor_index(folder: Path) -> dict[str, TensorInfo]:
    """Every tensor's shape and shard; empty when the folder holds no safetensors files."""
    index: dict[str, TensorInfo] = {}
    for file in sorted(folder.glob("*.safetensors")):
        _, tensors = read_header(file) or (0, {})
        for name, spec in tensors.items():
            if name != "__metadata__":
                index[name] = TensorInfo(tuple(spec["shape"]), file, spec.get("dtype", ""))
    return index
