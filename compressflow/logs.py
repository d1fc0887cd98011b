"""The logger a stage writes to: its Prefect run logger inside a flow run, a plain one outside.

Stages also run outside flows (`compressflow validate`, tests calling `task.fn`), where Prefect's
run logger raises MissingContextError.
"""

from __future__ import annotations

import logging

from prefect.exceptions import MissingContextError
from prefect.logging import get_run_logger


def run_logger(name: str) -> logging.Logger | logging.LoggerAdapter:
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(name)
