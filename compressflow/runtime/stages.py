"""Runs the flow's stages and keeps a record of each: how long it took and whether it was cached.

The record goes into the manifest and the final summary, which is how a person sees that a rerun
reused the fetched model and the built dataset. A cached result that points at a folder someone
deleted is rebuilt rather than passed on.
"""

from __future__ import annotations

import time

from compressflow.logs import run_logger
from compressflow.reporting import tracking
from compressflow.results import StageRecord


class Stages:
    """Calls Prefect tasks in order and records a StageRecord for each."""

    def __init__(self):
        self.records: list[StageRecord] = []

    def run(self, stage, *args, **kwargs):
        if not hasattr(stage, "with_options"):  # a plain check between stages: not a stage
            return stage(*args, **kwargs)
        started = time.perf_counter()
        state = stage(*args, return_state=True, **kwargs)
        result = state.result()
        cached = state.name == "Cached"
        if cached and result is not None and hasattr(result, "exists") and not result.exists():
            run_logger(__name__).warning(
                "%s: cached result points at %s, which no longer exists; rebuilding",
                stage.name,
                result.path,
            )
            result, cached = stage.with_options(refresh_cache=True)(*args, **kwargs), False
        elif cached and result is not None:
            tracking.log_result(result)  # the task body, which logs, did not run
        self.record(stage.name, time.perf_counter() - started, cached)
        return result

    def record(self, name: str, seconds: float, cached: bool = False) -> None:
        self.records.append(StageRecord(name=name, seconds=round(seconds, 3), cached=cached))
        if cached:
            run_logger(__name__).info("%s: reused cached result (%.2f s)", name, seconds)
