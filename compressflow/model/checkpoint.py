"""What a safetensors checkpoint holds, from its headers alone: no weight is read.

Fetch counts parameters with it, the memory plan finds the modules model_free_ptq must be told
to leave alone, and verify compares saved names with the source's and finds each source tensor's
shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    file: Path


def tensor_index(folder: Path) -> dict[str, TensorInfo]:
    """Every tensor's shape and shard; empty when the folder holds no safetensors files."""
    from safetensors import safe_open

    index: dict[str, TensorInfo] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                index[name] = TensorInfo(tuple(handle.get_slice(name).get_shape()), file)
    return index
