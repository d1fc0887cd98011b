"""Files replaced whole: a reader (a resuming calibration, a run deciding to reuse an output)
sees the old file or the new one, never half of one."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, write) -> None:
    """`write(tmp_path)`, flushed to disk, then renamed over `path`."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
