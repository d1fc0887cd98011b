"""Disk space: refuse a run whose checkpoint cannot fit; say so clearly when a save fills the disk.

The check runs before calibration, so a full disk costs seconds rather than hours of GPU. Only a
clear shortfall is refused: less free space than the quantized weights alone need (parameters x
the scheme's weight bits). The real checkpoint is larger (embeddings and `lm_head` usually stay
unquantized) but by how much depends on the model, so between that floor and the original size the
run only warns. Writes that still hit a full disk (ENOSPC, EDQUOT, EFBIG) become a PublishError
naming the folder and the free space; the flow then removes the staging folder, so nothing is
published.
"""

from __future__ import annotations

import errno
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError

from compressflow.errors import PublishError
from compressflow.logs import run_logger
from compressflow.results import FetchedModel

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
# safetensors' Rust writer reports I/O errors as text: "No space left on device (os error 28)".
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
FIX = "free space there, or set output.save_directory to a disk with more room"


def human(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000:
            return f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


def weight_bits(scheme: str | None) -> int | None:
    """Bits per quantized weight of a compressed-tensors preset (W4A16 -> 4); None if unknown."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    bits = [
        weights.num_bits
        for name in (scheme or "").split("+")  # the renderer joins a scheme mapping with "+"
        if (weights := PRESET_SCHEMES.get(name, {}).get("weights")) is not None
    ]
    return min(bits) if bits else None


def minimum_checkpoint_bytes(
    model: FetchedModel, scheme: str | None, save_compressed: bool
) -> int | None:
    """A floor the saved checkpoint cannot go below; None when the scheme says nothing about it."""
    if not save_compressed:
        return model.size_bytes  # saved in the original dtype, fake-quantized
    bits = weight_bits(scheme)
    if bits is None:
        return None
    if model.parameters is None:  # not safetensors: assume 32-bit originals, the smallest floor
        return model.size_bytes * bits // 32
    return model.parameters * bits // 8


def check_free_space(
    folder: Path, model: FetchedModel, scheme: str | None, save_compressed: bool
) -> None:
    """Refuse when `folder` clearly cannot hold the checkpoint; warn when it may not."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())  # validate: not made yet
    free = shutil.disk_usage(existing).free
    floor = minimum_checkpoint_bytes(model, scheme, save_compressed)
    if floor is not None and free < floor:
        raise PublishError(
            "output.save_directory",
            f"{folder} has {human(free)} free, but the compressed model needs at least "
            f"{human(floor)} (its original is {human(model.size_bytes)})",
            FIX,
        )
    if free < model.size_bytes:
        run_logger(__name__).warning(
            "%s has %s free; the compressed model may need up to %s (the original's size)",
            folder,
            human(free),
            human(model.size_bytes),
        )


def disk_full_errno(exc: BaseException) -> int | None:
    code = exc.errno if isinstance(exc, OSError) else None
    if isinstance(exc, SafetensorError) and (match := _RUST_OS_ERROR.search(str(exc))):
        code = int(match.group(1))
    return code if code in DISK_FULL_ERRNOS else None


@contextmanager
def disk_full_is_clear(folder: Path) -> Iterator[None]:
    """Turn a 'disk full' failure while writing into `folder` into a PublishError that says so."""
    try:
        yield
    except (OSError, SafetensorError) as exc:
        code = disk_full_errno(exc)
        if code is None:
            raise
        free = shutil.disk_usage(folder.parent).free
        raise PublishError(
            "output.save_directory",
            f"disk full while saving to {folder} ({errno.errorcode[code]}: {exc}); "
            f"{human(free)} free there; nothing was published",
            FIX,
        ) from exc


def folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
