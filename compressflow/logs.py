"""The logger a stage writes to: its Prefect run logger inside a flow run, a plain one outside.

Stages also run outside flows (`compressflow validate`, tests calling `task.fn`), where Prefect's
run logger raises MissingContextError. A stage's child process never imports Prefect (its
forkserver leaves it out: 70 MB resident), and so has no run context to look in.
"""

from __future__ import annotations

import logging
import sys


def run_logger(name: str) -> logging.Logger | logging.LoggerAdapter:
    if "prefect" not in sys.modules:
        return logging.getLogger(name)
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(name)


def stage_name() -> str | None:
    """The running Prefect task's name ("build held-out text"); None outside a task run, and in
    a process that has not imported Prefect (a stage's child, `compressflow validate`)."""
    if "prefect" not in sys.modules:
        return None
    from prefect.context import TaskRunContext

    context = TaskRunContext.get()
    return context.task.name if context is not None else None
