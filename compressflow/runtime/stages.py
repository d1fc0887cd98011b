"""Runs the flow's stages, keeps a record of each, and is each stage's boundary for errors.

The record (how long it took, whether it was cached) goes into the manifest and the final
summary, which is how a person sees that a rerun reused the fetched model and the built dataset.
A cached result that points at a folder someone deleted is rebuilt rather than passed on.

The boundary: our errors (field, problem, fix) pass as they are; anything else that escapes a
stage becomes a `StageDefect` naming the stage, with the library's words in its message and
its traceback in the run's log; a stage stopped at its time limit becomes `StageTimedOut`
naming the parameter that set it. A raw library exception never becomes the run's message.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

from compressflow.errors import CompressflowError, StageDefect, StageTimedOut
from compressflow.logs import run_logger
from compressflow.reporting import tracking
from compressflow.results import StageRecord

# What less to do means for the stage each time limit belongs to.
LESS_WORK = {
    "calibration.timeout_minutes": "fewer dataset.text_samples, a shorter dataset.max_seq_len",
    "lm_eval.timeout_minutes": "a smaller lm_eval.limit, fewer lm_eval.tasks",
}


@contextmanager
def boundary(stage: str, timeout_field: str = "") -> Iterator[None]:
    """What escapes the block, translated (the module docstring says how); `timeout_field` is
    the parameter that sets the stage's time limit, when it has one."""
    try:
        yield
    except CompressflowError:
        raise
    except TimeoutError as exc:
        if not timeout_field:
            raise _defect(stage, exc) from exc
        less = LESS_WORK.get(timeout_field)
        raise StageTimedOut(
            timeout_field,
            f"the {stage} stage ran past the limit it sets and was stopped; nothing was published",
            f"raise {timeout_field} (0: no limit), or give the stage less to do"
            + (f" ({less})" if less else ""),
        ) from exc
    except Exception as exc:
        raise _defect(stage, exc) from exc


def _defect(stage: str, exc: Exception) -> StageDefect:
    text = "".join(traceback.format_exception(exc))
    run_logger(__name__).error(
        "The %s stage failed on what it does not check for:\n%s", stage, text
    )
    return StageDefect.of(stage, exc)


class Stages:
    """Calls Prefect tasks in order, each inside its boundary, and records a StageRecord for each.

    `timeout_fields`: stage name -> the parameter that sets its time limit.
    """

    def __init__(self, timeout_fields: dict[str, str] | None = None):
        self.records: list[StageRecord] = []
        self.timeout_fields = timeout_fields or {}

    def run(self, stage, *args, **kwargs):
        name = getattr(stage, "name", None) or getattr(stage, "__name__", "check")
        with boundary(name.replace("_", " "), self.timeout_fields.get(name, "")):
            return self._run(stage, *args, **kwargs)

    def _run(self, stage, *args, **kwargs):
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
