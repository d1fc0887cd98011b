"""What every flow opens its stages with: the flow's boundary, then its ClearML task.

compress-model, evaluate-model and sweep-recipe each check the worker's settings first, then run
their stages inside `opened`: what escapes the stages' own boundaries is translated outside them
(compressflow/runtime/stages.py), and the run is logged to ClearML (its settings block is loaded
inside the boundary: what goes wrong loading it is translated too).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from compressflow.blocks.clearml_settings import load_clearml_settings
from compressflow.params import TrackingArgs
from compressflow.reporting.tracking import Tracker, track_flow_run
from compressflow.runtime.stages import boundary


@contextmanager
def opened(
    flow: str, tracking: TrackingArgs, title: str, tags: list[str], recorded: dict[str, Any]
) -> Iterator[Tracker]:
    """The run of `flow`, in its boundary and logged as `title` with `tags` and the `recorded`
    inputs (by group); yields the tracker the flow reports to."""
    with (
        boundary(flow),
        track_flow_run(
            tracking, load_clearml_settings(tracking.clearml_block), title, tags, recorded
        ) as tracker,
    ):
        yield tracker
