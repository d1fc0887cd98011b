"""Calibrate: the Prefect face of calibration; the work is compressflow.calibration.run's.

The task takes a GPU slot (the one the compress flow holds already, inside it), starts `calibrate_here` in a process of its own (or one rank per GPU),
drives the progress artifact from its events and reports its per-module metrics. A run without
a target calibrates once, as asked: `AS_ASKED`, the simplest target strategy
(compressflow/runtime/strategies.py).
"""

from __future__ import annotations

import re

from prefect import task
from prefect.cache_policies import NO_CACHE

from compressflow.calibration.run import calibrate_here
from compressflow.inputs import Inputs
from compressflow.logs import run_logger
from compressflow.model import cpus
from compressflow.model.offload import stage_offload_folder
from compressflow.reporting import tracking
from compressflow.reporting.progress import CalibrationProgress
from compressflow.results import Calibration, MemoryPlan
from compressflow.runtime.distributed import run_distributed
from compressflow.runtime.gpus import gpu_slots
from compressflow.runtime.isolation import run_isolated
from compressflow.runtime.strategies import Calibrating, Outcome, Strategy


def layer_index(module_name: str) -> int:
    """`model.layers.3.mlp.up_proj` -> 3, so errors plot against depth; 0 when there is none."""
    match = re.search(r"\.(\d+)\.", module_name)
    return int(match.group(1)) if match else 0


@task(name="calibrate", cache_policy=NO_CACHE)
def calibrate(inputs: Inputs, plan: MemoryPlan, staging_path: str) -> Calibration:
    """Calibrate `inputs.recipe` in a process of its own (`calibrate_here`) and report it.

    The task's process keeps the progress artifact, the run log and ClearML; the child holds the
    model, so a timeout or cancellation that ends the task ends the calibration and frees its
    memory (compressflow.runtime.isolation). On a GPU host it first takes a free GPU's slot
    (`calibration.gpus` slots: compressflow.runtime.gpus; inside the compress flow, the ones the
    flow holds) and holds it until the child is gone; with more than one GPU, torchrun starts one rank per GPU (compressflow.runtime.distributed).
    """
    calibration = inputs.args.calibration
    progress: list[CalibrationProgress] = []

    def on_event(kind: str, payload) -> None:
        if kind == "progress":
            progress.append(CalibrationProgress(*payload))
            progress[0].start()
        elif kind == "subgraph" and progress:
            progress[0].subgraph_done()

    with (
        stage_offload_folder(plan, "calibrate") as staged,
        gpu_slots(calibration.gpus, calibration.timeout_minutes * 60 or None) as devices,
    ):
        job = (calibrate_here, (inputs, staged, staging_path))
        if calibration.gpus > 1:
            result = run_distributed(*job, calibration.gpus, devices, on_event, "calibration")
        else:
            environment = {"CUDA_VISIBLE_DEVICES": ",".join(devices)} if devices else {}
            if calibration.threads:
                environment[cpus.OVERRIDE] = str(calibration.threads)
            result = run_isolated(*job, on_event, "calibration", environment)
    if progress:
        progress[0].finish()
        result = result.model_copy(update={"layers": progress[0].layers})
    report(result)
    return result


def as_asked(calibrating: Calibrating) -> Outcome:
    """The recipe as asked, calibrated once: nothing to search."""
    recipe = calibrating.inputs.recipe
    return calibrating.calibrate(recipe), recipe, None


# The strategy of a run without a target (flows/strategies.py lists it).
AS_ASKED = Strategy(
    name="as asked", applies=lambda recipe, target: not target.wanted(), run=as_asked
)


def report(result: Calibration) -> None:
    log = run_logger(__name__)
    what = f"Calibrated {len(result.modules)} module(s)" if result.modules else "Quantized"
    log.info("%s in %.1f s; peak RSS %.0f MB", what, result.seconds, result.peak_rss_mb)
    tracker = tracking.current()
    for module in result.modules:
        series = module.name.rsplit(".", 1)[-1]
        if module.error is not None:
            tracker.scalar(
                "quantization error by layer", series, module.error, layer_index(module.name)
            )
        if module.seconds is not None:
            tracker.scalar(
                "calibration seconds by layer", series, module.seconds, layer_index(module.name)
            )
    tracker.single("calibration seconds", result.seconds)
    tracker.single("peak RSS MB", result.peak_rss_mb)
    if result.peak_gpu_mb is not None:
        tracker.single("peak GPU MB", result.peak_gpu_mb)
