"""ClearML logging for the pipeline's stages, behind one small facade.

One ClearML task is opened per flow run (`open_run`); every Prefect task logs its own part into it
through `current()`, which finds the process's ClearML task the way the SDK intends
(`Task.current_task()`, valid from any thread). When tracking is off, or ClearML failed, `current()`
returns a tracker that does nothing, so stages never branch on whether ClearML is there.

A tracking failure never fails the compression: each call is guarded, the first failure is logged
with its reason and recorded, and later calls become no-ops.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Repository detection spawns git and can hang close(); every key must be given because a
# missing one defaults to True (FIELD_NOTES). No framework is auto-logged: the model is saved
# by the publish stage, not by a torch.save hook.
AUTO_CONNECT_FRAMEWORKS = {
    "detect_repository": False,
    "matplotlib": False, "tensorflow": False, "tensorboard": False, "pytorch": False,
    "xgboost": False, "scikit": False, "fastai": False, "lightgbm": False, "hydra": False,
    "joblib": False, "megengine": False, "catboost": False, "gradio": False, "jsonargparse": False,
}  # fmt: skip


@dataclass
class Tracker:
    """Logs into one ClearML task; every method is a no-op when `task` is None."""

    task: Any = None
    failures: list[str] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.task is not None

    def _call(self, what: str, fn, *args, **kwargs) -> None:
        if self.task is None:
            return
        try:
            fn(*args, **kwargs)
        except Exception as exc:  # tracking must never break a compression run
            reason = f"ClearML {what} failed: {type(exc).__name__}: {exc}"
            log.warning("%s; tracking is off for the rest of this run", reason)
            self.failures.append(reason)
            self.task = None

    def params(self, section: str, values: dict[str, Any]) -> None:
        """Hyperparameters under `section` (shown in the ClearML CONFIGURATION tab)."""
        flat = {k: v if isinstance(v, (int, float, bool, str)) else str(v) for k, v in values.items()}
        self._call("connect", self.task.connect if self.task else None, flat, name=section)

    def configuration(self, name: str, text: str, description: str = "") -> None:
        self._call(
            "connect_configuration",
            self.task.connect_configuration if self.task else None,
            configuration=text,
            name=name,
            description=description,
        )

    def scalar(self, title: str, series: str, value: float, iteration: int = 0) -> None:
        logger = self.task.get_logger() if self.task else None
        self._call(
            "report_scalar",
            logger.report_scalar if logger else None,
            title=title,
            series=series,
            value=float(value),
            iteration=iteration,
        )

    def single(self, name: str, value: float) -> None:
        logger = self.task.get_logger() if self.task else None
        self._call("report_single_value", logger.report_single_value if logger else None, name, value)

    def text(self, message: str) -> None:
        logger = self.task.get_logger() if self.task else None
        self._call("report_text", logger.report_text if logger else None, message)

    def artifact(self, name: str, obj: Any) -> None:
        self._call(
            "upload_artifact",
            self.task.upload_artifact if self.task else None,
            name=name,
            artifact_object=obj,
            wait_on_upload=True,
        )


def current() -> Tracker:
    """The tracker for this process's ClearML task, or a no-op one when none is open."""
    if os.environ.get("COMPRESSFLOW_TRACKING", "1") == "0":
        return Tracker()
    try:
        from clearml import Task

        return Tracker(task=Task.current_task())
    except Exception as exc:  # ClearML not importable or misconfigured: run untracked
        log.warning("ClearML unavailable (%s); running without tracking", exc)
        return Tracker()


def clearml_configured() -> bool:
    """Whether a ClearML server is configured (environment or clearml.conf) and not forced off."""
    if os.environ.get("CLEARML_OFFLINE_MODE", "").lower() in ("1", "true", "yes"):
        return False
    if os.environ.get("CLEARML_API_HOST") or os.environ.get("CLEARML_CONFIG_FILE"):
        return True
    return Path("~/clearml.conf").expanduser().exists()


@contextmanager
def open_run(
    project: str, name: str, tags: list[str], comment: str = "", enabled: bool = True
) -> Iterator[Tracker]:
    """Open the flow run's ClearML task (offline when no server is configured) and close it."""
    if not enabled or os.environ.get("COMPRESSFLOW_TRACKING", "1") == "0":
        yield Tracker()
        return
    tracker = Tracker()
    try:
        from clearml import Task
        from clearml.backend_interface.task.task import Task as BackendTask

        # The reporter's forked subprocess made close() take 6-300 s (FIELD_NOTES); in-process
        # reporting closes in ~0.02 s.
        BackendTask._report_subprocess_enabled = False
        if not clearml_configured():
            Task.set_offline(True)
            log.info("ClearML: no server configured, logging offline (see README to import)")
        tracker.task = Task.init(
            project_name=project,
            task_name=name,
            tags=tags or None,
            reuse_last_task_id=False,
            auto_connect_frameworks=AUTO_CONNECT_FRAMEWORKS,
            auto_connect_arg_parser=False,
            auto_resource_monitoring=False,
        )
        if comment:
            tracker.task.set_comment(comment)
    except Exception as exc:  # a tracking outage must not stop a compression
        tracker.failures.append(f"ClearML Task.init failed: {type(exc).__name__}: {exc}")
        log.warning("%s; continuing without tracking", tracker.failures[-1])
        tracker.task = None
    try:
        yield tracker
    finally:
        task = tracker.task
        tracker.task = None
        if task is not None:
            task.close()
