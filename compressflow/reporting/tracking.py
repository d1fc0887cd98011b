"""ClearML logging for the pipeline's stages, behind one small facade.

One ClearML task is opened per flow run (`open_run`); every Prefect task logs its own part into it
through `current()`, which finds the process's ClearML task the way the SDK intends
(`Task.current_task()`, valid from any thread). When tracking is off, or ClearML failed, `current()`
returns a tracker that does nothing, so stages never branch on whether ClearML is there.

Where the run is logged:
- a `ClearMLSettings` block named by the flow: that server, with the block's credentials;
- else the SDK's own configuration (CLEARML_* variables or clearml.conf);
- else offline mode: a session folder (and zip) to import later (see docs/clearml.md).

A tracking failure never fails the compression, and never hangs it: the server is probed with a
timeout before Task.init (unreachable: log offline instead), every call is guarded (the first
failure is recorded with its reason, later calls become no-ops), and close() runs under a timeout.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compressflow import compat
from compressflow.logs import run_logger
from compressflow.reporting.result_logs import log_to
from compressflow.settings import settings as worker_settings

if TYPE_CHECKING:
    from compressflow.params import TrackingArgs


CLOSE_TIMEOUT_SECONDS = 30.0
FAILURES_ATTR = "_compressflow_tracking_failures"


def marked_failures(task: Any) -> list[str]:
    """Failures recorded on `task`. Read from its __dict__: a ClearML Task's __getattr__ answers
    unknown names with a StubObject in some processes (seen under Prefect workers)."""
    return vars(task).get(FAILURES_ATTR, []) if task is not None else []


# Repository detection spawns git and can hang close(); every key must be given because a
# missing one defaults to True (measured with clearml 2.1.12). No framework is auto-logged: the model is saved
# by the publish stage, not by a torch.save hook.
AUTO_CONNECT_FRAMEWORKS = {
    "detect_repository": False,
    "matplotlib": False,
    "tensorflow": False,
    "tensorboard": False,
    "pytorch": False,
    "xgboost": False,
    "scikit": False,
    "fastai": False,
    "lightgbm": False,
    "hydra": False,
    "joblib": False,
    "megengine": False,
    "catboost": False,
    "gradio": False,
    "jsonargparse": False,
}


@dataclass
class Tracker:
    """Logs into one ClearML task; every method is a no-op when `task` is None."""

    task: Any = None
    failures: list[str] = field(default_factory=list)
    mode: str = "off"  # "online", "offline" or "off"
    location: str | None = None  # web page online, session folder offline

    def status(self) -> str:
        """One line for the run's result: where it was logged and what failed."""
        where = f"{self.mode}" + (f": {self.location}" if self.location else "")
        return where + "".join(f"; FAILED: {reason}" for reason in self.failures)

    @property
    def active(self) -> bool:
        return self.task is not None

    def _call(self, what: str, method: str, *args, logger: bool = False, **kwargs) -> None:
        if self.task is None or marked_failures(self.task):
            return
        try:
            target = self.task.get_logger() if logger else self.task
            getattr(target, method)(*args, **kwargs)
        except Exception as exc:  # tracking must never break a compression run
            self.fail(f"ClearML {what} failed: {type(exc).__name__}: {exc}")

    def fail(self, reason: str) -> None:
        run_logger(__name__).warning("%s; tracking is off for the rest of this run", reason)
        self.failures.append(reason)
        # Trackers are cheap views of one ClearML task: the mark on the task is what turns
        # tracking off for every stage and lets the flow report the failure at the end.
        setattr(self.task, FAILURES_ATTR, [*marked_failures(self.task), reason])
        self.task = None

    def params(self, section: str, values: dict[str, Any]) -> None:
        """Hyperparameters under `section` (shown in the ClearML CONFIGURATION tab)."""
        # Keys as text: ClearML's connect takes a dict as keyword arguments, and a numbered one
        # (a recipe's notes) failed with "keywords must be strings", switching tracking off.
        flat = {
            str(k): v if isinstance(v, (int, float, bool, str)) else str(v)
            for k, v in values.items()
        }
        self._call("connect", "connect", flat, name=section)

    def configuration(self, name: str, text: str, description: str = "") -> None:
        # connect_configuration would read a str as a file path; this stores the text itself.
        self._call(
            "set_configuration_object",
            "set_configuration_object",
            name=name,
            config_text=text,
            description=description,
        )

    def scalar(self, title: str, series: str, value: float, iteration: int = 0) -> None:
        self._call(
            "report_scalar",
            "report_scalar",
            title=title,
            series=series,
            value=float(value),
            iteration=iteration,
            logger=True,
        )

    def single(self, name: str, value: float) -> None:
        self._call("report_single_value", "report_single_value", name, value, logger=True)

    def text(self, message: str) -> None:
        self._call("report_text", "report_text", message, logger=True)

    def table(self, title: str, rows: list[dict]) -> None:
        """Rows as a list with a header row: ClearML's DataFrame path needs pandas (see
        `import_clearml`). Non-finite numbers are spelled out as the DataFrame path does."""
        columns = list(dict.fromkeys(key for row in rows for key in row))
        cells = [[_cell(row.get(column, "")) for column in columns] for row in rows]
        self._call(
            "report_table",
            "report_table",
            title=title,
            series=title,
            iteration=0,
            table_plot=[columns, *cells],
            logger=True,
        )

    def scatter(self, title: str, series: str, points: list[list[float]], axes: tuple[str, str]):
        """Points (x, y) as one series of a ClearML scatter plot (the PLOTS tab)."""
        self._call(
            "report_scatter2d",
            "report_scatter2d",
            title=title,
            series=series,
            iteration=0,
            scatter=points,
            xaxis=axes[0],
            yaxis=axes[1],
            mode="markers",
            logger=True,
        )

    def bars(
        self, title: str, series: str, values: list[float], labels: list[str], axes: tuple[str, str]
    ) -> None:
        """Values as one series of a ClearML bar chart, a bar per label (the PLOTS tab); series
        of one title are drawn side by side."""
        self._call(
            "report_histogram",
            "report_histogram",
            title=title,
            series=series,
            values=values,
            iteration=0,
            xlabels=labels,
            xaxis=axes[0],
            yaxis=axes[1],
            mode="group",
            logger=True,
        )

    def artifact(self, name: str, obj: Any) -> None:
        self._call(
            "upload_artifact",
            "upload_artifact",
            name=name,
            artifact_object=obj,
            wait_on_upload=True,
        )

    def register_model(
        self, folder: Path, name: str, tags: list[str], metadata: dict, uri: str = ""
    ) -> None:
        """Register the published model as the task's OutputModel; offline, record it as an
        artifact. With `uri` (where it was uploaded: output.upload_uri) the model is registered
        at that URI, which ClearML only records: the store holds it already, so no second copy
        of the weights is zipped and uploaded. Without one, the local `folder` is packaged."""
        if self.task is None:
            return
        if self.mode == "offline":
            # OutputModel needs a server (it fails on the offline dummy model); the folder is
            # referenced, not zipped into the session: real checkpoints are tens of GB.
            self.artifact(
                "compressed-model",
                {"path": str(folder), "uri": uri or folder.as_uri(), **metadata},
            )
            self.text(
                f"Offline: compressed model recorded as artifact 'compressed-model' "
                f"({uri or folder}); OutputModel registration happens online only"
            )
            return
        try:
            from clearml import OutputModel

            model = OutputModel(task=self.task, name=name, tags=tags, framework="PyTorch")
            if uri:
                model.update_weights(register_uri=uri, auto_delete_file=False)
            else:
                model.update_weights_package(weights_path=str(folder), auto_delete_file=False)
            for key, value in metadata.items():
                model.set_metadata(key, str(value), v_type="str")
        except Exception as exc:  # registration failing must not fail the published model
            self.fail(f"ClearML OutputModel registration failed: {type(exc).__name__}: {exc}")

    def connect_input_model(self, model: Any) -> None:
        """Lineage: the ClearML model this run started from."""
        self._call("connect input model", "connect", model)

    def link(self) -> str | None:
        """The task's web page online, or its offline session folder."""
        if self.task is None:
            return None
        try:
            if self.mode == "offline":
                return str(self.task.get_offline_mode_folder())
            return self.task.get_output_log_web_page()
        except Exception as exc:  # a missing link is not worth failing tracking for
            run_logger(__name__).warning("ClearML task link unavailable: %s", exc)
            return None


def _cell(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Inf" if value > 0 else "-Inf")
    return value


# Imported by clearml at import time only for DataFrame tables, CSV artifacts and dataset
# previews, none of which compressflow uses: 42 MB of the flow process (clearml 2.1.12).
CLEARML_OPTIONAL = ("pandas", "pyarrow")


def import_clearml():
    """The clearml package, imported without its optional heavy modules unless this process
    already loaded them: the flow's process stays light (issue 23). `Tracker.table` sends lists
    of rows, which need no pandas."""
    if "clearml" not in sys.modules:
        blocked = [name for name in CLEARML_OPTIONAL if name not in sys.modules]
        sys.modules.update(dict.fromkeys(blocked))  # None there makes `import name` fail
        try:
            import clearml
        finally:
            for name in blocked:
                del sys.modules[name]
    import clearml

    return clearml


def current() -> Tracker:
    """The tracker for this process's ClearML task, or a no-op one when none is open."""
    try:
        task = import_clearml().Task.current_task()
    except Exception as exc:  # ClearML not importable or misconfigured: run untracked
        run_logger(__name__).warning("ClearML unavailable (%s); running without tracking", exc)
        return Tracker()
    if task is None or marked_failures(task):
        return Tracker()
    return Tracker(task=task, mode="offline" if task.is_offline() else "online")


def log_result(result) -> None:
    """Log a stage result into the run's ClearML task (`result_logs.log_to` says what of it).

    Stages call it when they finish; the flow's stage runner calls it for a cached result, whose
    task body did not run: either way the ClearML task gets the same fields.
    """
    log_to(result, current())


def configured_api_host() -> str | None:
    """The API host of the SDK's own configuration (environment or clearml.conf), if any."""
    if os.environ.get("CLEARML_API_HOST"):
        return os.environ["CLEARML_API_HOST"]
    if os.environ.get("CLEARML_CONFIG_FILE") or Path("~/clearml.conf").expanduser().exists():
        from clearml.backend_api import Session

        return Session.get_api_server_host()
    return None


def unreachable_reason(api_host: str, timeout: float) -> str | None:
    """Why the ClearML API server cannot be reached in `timeout` seconds; None when it can.

    The SDK retries an unreachable server for minutes: one bounded request decides first.
    """
    import requests

    try:
        requests.get(f"{api_host.rstrip('/')}/debug.ping", timeout=timeout)
    except requests.RequestException as exc:
        return f"ClearML server {api_host} unreachable ({type(exc).__name__}: {exc})"
    return None


def _close(task, tracker: Tracker) -> None:
    """close() flushes reports to the server; bound it so an outage cannot hang the flow."""
    closer = threading.Thread(target=task.close, name="clearml-close", daemon=True)
    closer.start()
    closer.join(CLOSE_TIMEOUT_SECONDS)
    if closer.is_alive():
        tracker.failures.append(
            f"ClearML close() did not finish in {CLOSE_TIMEOUT_SECONDS:.0f} s; the server may "
            "have missed the run's last reports"
        )
        run_logger(__name__).warning(tracker.failures[-1])


@contextmanager
def open_run(
    project: str,
    name: str,
    tags: list[str],
    comment: str = "",
    enabled: bool = True,
    settings: Any = None,
    connect_timeout: float = 10.0,
) -> Iterator[Tracker]:
    """Open the flow run's ClearML task, yield its Tracker, and close it (bounded)."""
    tracker = Tracker()
    if not enabled or not worker_settings().tracking:
        yield tracker
        return
    try:
        Task = import_clearml().Task
        compat.clearml_report_in_process()
        if settings is not None:
            Task.set_credentials(
                api_host=settings.api_host,
                web_host=settings.web_host,
                files_host=settings.files_host,
                key=settings.access_key.get_secret_value(),
                secret=settings.secret_key.get_secret_value(),
            )
            api_host, connect_timeout = settings.api_host, settings.connect_timeout_seconds
        else:
            api_host = configured_api_host()
        forced_offline = os.environ.get("CLEARML_OFFLINE_MODE", "").lower() in ("1", "true", "yes")
        if api_host and not forced_offline:
            if reason := unreachable_reason(api_host, connect_timeout):
                tracker.failures.append(f"{reason}; logged offline instead")
                run_logger(__name__).warning(tracker.failures[-1])
                api_host = None
        # ClearML marks child processes of a tracked process with this variable and hands them a
        # stub task. A flow run is its own ClearML task, whatever process started its worker.
        for marker in ("CLEARML_PROC_MASTER_ID", "TRAINS_PROC_MASTER_ID"):
            if os.environ.get(marker, "").split(":")[0] != str(os.getpid()):
                os.environ.pop(marker, None)
        if not api_host or forced_offline:
            Task.set_offline(True)
            run_logger(__name__).info(
                "ClearML: no reachable server configured, logging offline (see docs/clearml.md)"
            )
        tracker.task = Task.init(
            project_name=project,
            task_name=name,
            tags=tags or None,
            reuse_last_task_id=False,
            auto_connect_frameworks=AUTO_CONNECT_FRAMEWORKS,
            auto_connect_arg_parser=False,
            auto_resource_monitoring=False,
            output_uri=settings.output_uri if settings else None,
        )
        if not isinstance(tracker.task, Task):
            raise RuntimeError(f"ClearML returned {type(tracker.task).__name__}, not a Task")
        tracker.mode = "offline" if Task.is_offline() else "online"
        tracker.location = tracker.link()
        if comment:
            tracker.task.set_comment(comment)
    except Exception as exc:  # a tracking outage must not stop a compression
        tracker.task = None
        tracker.failures.append(f"ClearML Task.init failed: {type(exc).__name__}: {exc}")
        run_logger(__name__).warning("%s; continuing without tracking", tracker.failures[-1])
    try:
        yield tracker
    finally:
        task, tracker.task = tracker.task, None
        if task is not None:
            tracker.failures.extend(marked_failures(task))
            _close(task, tracker)


@contextmanager
def track_flow_run(
    args: TrackingArgs,
    settings: Any,
    default_name: str,
    tags: list[str],
    inputs: dict[str, dict],
) -> Iterator[Tracker]:
    """open_run for a Prefect flow run: names, tags and links both ways, logs the inputs.

    `settings` is the ClearMLSettings block named by `args.clearml_block` (loaded by the flow:
    blocks sit above this layer), or None.
    """
    from prefect import runtime
    from prefect.artifacts import create_link_artifact, create_markdown_artifact

    from compressflow.reporting.artifacts import is_web_url, slug

    flow_run = runtime.flow_run
    with open_run(
        project=args.project_name or (settings.default_project if settings else "compressflow"),
        name=args.task_name or default_name,
        tags=[*tags, f"prefect-flow-run:{flow_run.id}"],
        comment=f"Prefect flow run {flow_run.name} ({flow_run.id})"
        + (f": {flow_run.ui_url}" if flow_run.ui_url else ""),
        enabled=args.enabled,
        settings=settings,
    ) as tracker:
        for group, values in inputs.items():
            tracker.params(f"{group} args", values)
        if tracker.location:
            key = slug(f"{default_name} clearml")
            if is_web_url(tracker.location):
                create_link_artifact(tracker.location, link_text="ClearML task", key=key)
            else:  # the UI opens no file:// links: show the offline folder to copy
                create_markdown_artifact(
                    f"ClearML task ({tracker.mode}): `{tracker.location}`", key=key
                )
        yield tracker
