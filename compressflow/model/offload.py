"""Where a plan keeps weights that stay on disk: the offload folder, a model loaded with its weights
read from the checkpoint's files, and each stage's own folder inside it.

The memory plan (memory.py) decides the placement and names the folder; calibration, verify and
their stages load and clean up here.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from compressflow.model.loading import load_complete
from compressflow.params import CalibrationArgs
from compressflow.results import FetchedModel, MemoryPlan


def offload_folder(args: CalibrationArgs, target: Path) -> str:
    """The user's folder, or one beside the output (local to the worker, removed after; one a
    killed run leaves is removed by the next, which knows it by this name and its dead pid)."""
    if args.offload_folder:
        return str(Path(args.offload_folder).expanduser().resolve())
    return str(target.parent / f".{target.name}.offload-{os.getpid()}")


def load_offloaded(model: FetchedModel, plan: MemoryPlan):
    """The source checkpoint as `model.model_class`, with what fits under the plan's
    weight budget in CPU memory and the rest read from its safetensors files when a module runs.

    compressed-tensors' offloading reads the checkpoint's own files: nothing is copied to the
    offload folder for weights that stay on disk, and each module's weights are read once per
    forward.
    """
    import transformers
    from compressed_tensors.offload import load_offloaded_model

    model_cls = getattr(transformers, model.model_class)
    Path(plan.offload_folder).mkdir(parents=True, exist_ok=True)
    with load_offloaded_model(model_cls):
        return load_complete(
            model_cls,
            model.path,
            "the source model",
            dtype="auto",
            trust_remote_code=model.trust_remote_code,
            device_map="auto_offload",
            max_memory={"cpu": plan.weights_in_memory_bytes},
            offload_folder=plan.offload_folder,
        )


@contextmanager
def stage_offload_folder(plan: MemoryPlan, stage: str) -> Iterator[MemoryPlan]:
    """`plan` with a fresh folder of `stage`'s own inside its offload folder, removed after.

    compressed-tensors names the files it offloads by the id() of a meta tensor, and children
    forked from one forkserver reuse ids: a reload into a folder calibration had left files in
    failed with FileExistsError (granite FP8_DYNAMIC read from disk). In a user's
    `offload_folder` it also removes exactly what the stage made there.
    """
    if plan.placement not in ("disk", "shards") or not plan.offload_folder:
        yield plan
        return
    Path(plan.offload_folder).mkdir(parents=True, exist_ok=True)
    own = tempfile.mkdtemp(prefix=f"{stage}-", dir=plan.offload_folder)
    try:
        yield plan.model_copy(update={"offload_folder": own})
    finally:
        shutil.rmtree(own, ignore_errors=True)
