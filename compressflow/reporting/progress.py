"""Calibration progress a person can watch: subgraph i of N, elapsed time and an ETA.

llm-compressor's sequential pipeline calibrates the model one subgraph (decoder layer) at a time
and, after each, calls `LifecycleCallbacks.sequential_epoch_end` (after the calibration pass, once
the modifiers have compressed that layer). `on_subgraph_done` wraps that call for the duration of
`oneshot`, and a CalibrationProgress, per subgraph, advances a Prefect progress artifact, logs "subgraph i/N done,
elapsed, ETA" through the run logger, and reports the same figures to ClearML.

Why that hook: `LifecycleCallbacks` is exported by `llmcompressor.core` and is the documented
per-layer event, looked up on the class at each call, so a wrapper installed for the duration
and restored in `finally` sees every subgraph without changing the recipe (a progress modifier
would be saved into the checkpoint's recipe.yaml) or parsing log lines. The pipeline keeps N to
itself, so it is computed the way it traces: one subgraph per module matched by the sequential
targets, plus the leading one (`trace_subgraphs` documents and checks that count). With the
default `independent` pipeline each modifier that needs data gets its own sequential pass (W8A8:
SmoothQuant, then GPTQ), so the total is passes x subgraphs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from compressflow.logs import run_logger
from compressflow.reporting import tracking
from compressflow.results import LayerTime

CLEARML_TITLE = "calibration progress"


def subgraphs_per_pass(model, sequential_targets: list[str] | None) -> int:
    """How many subgraphs the sequential pipeline will trace `model` into."""
    from compressed_tensors.utils import match_named_modules
    from llmcompressor.utils.pytorch import infer_sequential_targets

    targets = infer_sequential_targets(model, sequential_targets)
    targets = sorted(targets) if isinstance(targets, set) else list(targets)
    return len({id(module) for _, module in match_named_modules(model, targets)}) + 1


def sequential_passes(data_modifiers: int, pipeline: str | None) -> int:
    """Sequential passes oneshot makes: one per data modifier unless a pipeline is forced."""
    if pipeline in ("basic", "datafree"):
        return 0
    if pipeline == "sequential":
        return 1
    return data_modifiers


@dataclass
class CalibrationProgress:
    """Counts finished subgraphs and reports each to Prefect, the log and ClearML."""

    per_pass: int
    passes: int = 1
    done: int = 0
    started: float = field(default_factory=time.perf_counter)
    first_done: float | None = None
    last_done: float | None = None
    layers: list[LayerTime] = field(default_factory=list)
    artifact_id: object = None
    logger: object = field(default_factory=lambda: run_logger(__name__))

    @property
    def total(self) -> int:
        return max(self.per_pass * self.passes, self.done, 1)

    @property
    def percent(self) -> float:
        return round(100.0 * self.done / self.total, 1)

    def eta_seconds(self, now: float) -> float | None:
        """Mean time of the subgraphs after the first (the embeddings: not representative)."""
        if self.first_done is None or self.done < 2:
            return None
        return (now - self.first_done) / (self.done - 1) * (self.total - self.done)

    def position(self) -> tuple[int, int]:
        """(pass, subgraph) of the last subgraph done, both 0-based."""
        return divmod(self.done - 1, self.per_pass) if self.per_pass else (0, 0)

    def label(self) -> str:
        pass_index, index = self.position()
        text = f"subgraph {index + 1}/{self.per_pass}"
        return f"{text} of pass {pass_index + 1}/{self.passes}" if self.passes > 1 else text

    def start(self) -> None:
        self.artifact_id = _artifact_call(
            "create", progress=0.0, description=f"Calibrating {self.total} subgraph(s)"
        )

    def subgraph_done(self) -> None:
        now = time.perf_counter()
        self.done += 1
        if self.done == 1:
            self.first_done = now
        pass_index, index = self.position()
        seconds = now - (self.last_done or self.started)
        self.last_done = now
        self.layers.append(
            LayerTime(calibration_pass=pass_index + 1, layer=index, seconds=round(seconds, 3))
        )
        elapsed = now - self.started
        eta = self.eta_seconds(now)
        eta_text = f"{eta:.0f} s" if eta is not None else "unknown"
        message = (
            f"{self.label()} done ({self.percent:.0f}%), elapsed {elapsed:.1f} s, ETA {eta_text}"
        )
        self.logger.info("Calibration progress: %s", message)
        self._update(message)
        tracker = tracking.current()
        tracker.scalar(CLEARML_TITLE, "subgraphs done", self.done, iteration=self.done)
        tracker.scalar(CLEARML_TITLE, "percent", self.percent, iteration=self.done)
        tracker.scalar(CLEARML_TITLE, "elapsed seconds", elapsed, iteration=self.done)
        if eta is not None:
            tracker.scalar(CLEARML_TITLE, "ETA seconds", eta, iteration=self.done)
        tracker.scalar(
            "calibration seconds by subgraph", f"pass {pass_index + 1}", seconds, iteration=index
        )

    def finish(self) -> None:
        seconds = time.perf_counter() - self.started
        self.done = self.total  # basic/datafree pipelines send no per-subgraph events
        self._update(f"Calibrated {self.total} subgraph(s) in {seconds:.1f} s")

    def _update(self, description: str) -> None:
        if self.artifact_id is not None:
            self.artifact_id = _artifact_call(
                "update", self.artifact_id, progress=self.percent, description=description
            )


def _artifact_call(kind: str, *args, **kwargs):
    """Create or update the progress artifact; None outside a run or when the API fails."""
    from prefect.artifacts import create_progress_artifact, update_progress_artifact
    from prefect.context import TaskRunContext

    if TaskRunContext.get() is None:  # plain function call: no run to attach the artifact to
        return None
    try:
        fn = create_progress_artifact if kind == "create" else update_progress_artifact
        return fn(*args, **kwargs)
    except Exception as exc:  # progress display must never fail a calibration
        run_logger(__name__).warning(
            "Prefect progress artifact %s failed (%s); no more updates", kind, exc
        )
        return None


@contextmanager
def on_subgraph_done(callback: Callable[[], None]) -> Iterator[None]:
    """Call `callback` after each subgraph llm-compressor calibrates inside this block.

    Calibration runs in its own process (compressflow.runtime.isolation); there the callback sends an
    event to the task's process, which owns the CalibrationProgress and reports it.
    """
    from llmcompressor.core import LifecycleCallbacks

    original = LifecycleCallbacks.__dict__["sequential_epoch_end"]  # the classmethod object

    def sequential_epoch_end(cls, modules, **kwargs):
        result = original.__func__(cls, modules, **kwargs)  # the layer is compressed in here
        callback()
        return result

    LifecycleCallbacks.sequential_epoch_end = classmethod(sequential_epoch_end)
    try:
        yield
    finally:
        LifecycleCallbacks.sequential_epoch_end = original
