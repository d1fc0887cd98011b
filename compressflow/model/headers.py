"""The safetensors reader: what a checkpoint holds, from its headers alone (no weight is read).

Fetch counts parameters with it, the memory plan finds the modules model_free_ptq must be told
to leave alone, and verify compares saved names with the source's and finds each source tensor's
shard. The folder checks (compressflow/model/folder_checks/) refuse a file whose header this
reader cannot use.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from compressflow.limits import not_regular

# Bits per element of each dtype safetensors 0.8 reads: an entry of another is refused at load.
DTYPE_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
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
    dtype = spec.get("dtype", "")
    if not isinstance(dtype, str):
        raise HeaderError(f"tensor {name!r} has dtype {dtype!r}, not a name")
    if dtype not in DTYPE_BITS:
        raise HeaderError(
            f"tensor {name!r} has dtype {dtype!r:.40}, which safetensors does not know"
        )
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != offsets[1] - offsets[0]:
        size = f"{bits / 8:,}" if bits % 8 else f"{bits // 8:,}"
        raise HeaderError(
            f"tensor {name!r} is {dtype} of shape {shape}, {size} bytes, but its "
            f"data_offsets {offsets} hold {offsets[1] - offsets[0]:,}"
        )


def check_layout(tensors: dict) -> int:
    """Refuse byte ranges that do not tile the data from its first byte, one after another, as
    safetensors requires at load; returns where the data ends."""
    end = 0
    ranges = sorted(
        (spec["data_offsets"], name) for name, spec in tensors.items() if name != "__metadata__"
    )
    for (begin, stop), name in ranges:
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else "leaves a gap before it"
            raise HeaderError(f"tensor {name!r} starts at byte {begin:,} of the data and {what}")
        end = stop
    return end


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
    check_layout(tensors)
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


def parameter_count(path: Path) -> int | None:
    """Parameters counted from safetensors headers (no weights read); None for other formats."""
    index = tensor_index(path)
    return sum(math.prod(info.shape) for info in index.values()) if index else None
