"""What a safetensors checkpoint holds, from its headers alone: no weight is read.

Fetch counts parameters with it, the memory plan finds the modules model_free_ptq must be told
to leave alone, and verify compares saved names with the source's and finds each source tensor's
shard.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from compressflow.limits import not_regular

# safetensors' own reader refuses a longer header (MAX_HEADER_SIZE in its Rust crate): a file
# claiming more is not one it would load, and reading the claim would hold that much memory.
MAX_HEADER_BYTES = 100_000_000


class HeaderError(ValueError):
    """Why a safetensors header cannot be used; callers name the file and the fix."""


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    file: Path
    dtype: str = ""  # safetensors' name for it: BF16, F8_E4M3, ...


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_entry(name: str, spec) -> None:
    """Refuse a header entry safetensors would refuse at load: one whose shape or byte range
    is not non-negative integers."""
    if name == "__metadata__":
        if not isinstance(spec, dict):
            raise HeaderError(f"its __metadata__ is a JSON {type(spec).__name__}, not an object")
        return
    if not isinstance(spec, dict):
        raise HeaderError(f"tensor {name!r} is a JSON {type(spec).__name__}, not an object")
    shape, offsets = spec.get("shape"), spec.get("data_offsets")
    if not isinstance(shape, list) or not all(_is_count(dim) for dim in shape):
        raise HeaderError(f"tensor {name!r} has shape {shape!r}, not a list of sizes >= 0")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(offset) for offset in offsets)
        or offsets[0] > offsets[1]
    ):
        raise HeaderError(f"tensor {name!r} has data_offsets {offsets!r}, not [begin, end]")
    if not isinstance(spec.get("dtype", ""), str):
        raise HeaderError(f"tensor {name!r} has dtype {spec['dtype']!r}, not a name")


def read_header(file: Path) -> tuple[int, dict]:
    """(header length, header) of a safetensors file, read as JSON: safetensors' own reader
    imports torch, which the flow's process does not. Raises HeaderError saying what is wrong."""
    if kind := not_regular(file):
        raise HeaderError(f"it is {kind}, not a regular file")
    size = file.stat().st_size
    with file.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise HeaderError(f"it is {size} bytes, too short to hold a header")
        length = int.from_bytes(prefix, "little")
        if length > MAX_HEADER_BYTES:
            raise HeaderError(
                f"its header claims {length:,} bytes, over the {MAX_HEADER_BYTES:,} that "
                "safetensors reads at most"
            )
        if length > size - 8:
            raise HeaderError(f"its header claims {length:,} bytes, the file has {size:,}")
        header = handle.read(length)
    try:
        tensors = json.loads(header)
    except ValueError:  # not UTF-8, not JSON, or an integer too long to convert
        raise HeaderError("its header is not JSON (corrupt header)") from None
    except RecursionError:
        raise HeaderError("its header nests too deeply to parse") from None
    if not isinstance(tensors, dict):
        raise HeaderError(f"its header is a JSON {type(tensors).__name__}, not an object")
    for name, spec in tensors.items():
        check_entry(name, spec)
    return length, tensors


def tensor_index(folder: Path) -> dict[str, TensorInfo]:
    """Every tensor's shape and shard; empty when the folder holds no safetensors files.

    A file whose header is unusable is left out: fetch refuses such a source before this runs.
    """
    index: dict[str, TensorInfo] = {}
    for file in sorted(folder.glob("*.safetensors")):
        try:
            _, tensors = read_header(file)
        except HeaderError:
            continue
        for name, spec in tensors.items():
            if name != "__metadata__":
                index[name] = TensorInfo(tuple(spec["shape"]), file, spec.get("dtype", ""))
    return index
