"""The resumable calibration pipeline: llm-compressor's sequential loop, able to start again.

Missing upstream (llm-compressor issue #1410): the sequential pipeline has no start index,
takes no activations cache and has no hook at the end of a subgraph (after the propagate pass,
when the next subgraph's inputs are complete). So this is a copy of its 0.14.0.1 loop
(`pipelines/sequential/pipeline.py`) with those three added, and of `independent`'s loop (one
pass per modifier) around it, registered under its own name the library's way. The library's
pieces it runs on (its pipeline registry, activations cache, tracer...) come through
compressflow.compat (`sequential_pipeline_parts`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NamedTuple

from compressflow import compat

RESUMABLE_PIPELINE = "compressflow-resumable"


class Resuming(NamedTuple):
    """The checkpointer and pass grouping of the oneshot now running."""

    checkpointer: Any  # compressflow.calibration.resume.CalibrationCheckpoint
    independent: bool


# Set by `resumable_pipeline` around one oneshot; the registered pipeline reads it when oneshot
# calls it (in the same thread: the library builds the pipeline by name, with no arguments).
_resuming: ContextVar[Resuming] = ContextVar("compressflow_resuming")


@contextmanager
def resumable_pipeline(checkpointer, independent: bool) -> Iterator[str]:
    """Run oneshot's sequential passes through `RESUMABLE_PIPELINE` with `checkpointer`; yields
    the pipeline name to pass to oneshot.

    `checkpointer` (compressflow.calibration.resume.CalibrationCheckpoint) says where to resume
    (`resume_at()`: (pass, subgraph) or None), puts back finished layers (`restore`), gives the
    saved activations (`activations`) and takes each finished subgraph (`subgraph_done`).
    """
    _register_resumable()
    token = _resuming.set(Resuming(checkpointer, independent))
    try:
        yield RESUMABLE_PIPELINE
    finally:
        _resuming.reset(token)


@functools.cache
def _register_resumable() -> None:
    import torch
    from compressed_tensors.offload import disable_offloading, set_onload_device
    from compressed_tensors.utils import patch_attr
    from llmcompressor.core import LifecycleCallbacks, active_session
    from llmcompressor.modifiers.utils.hooks import HooksMixin
    from llmcompressor.utils.dev import get_main_device
    from llmcompressor.utils.helpers import DisableQuantization, calibration_forward_context
    from llmcompressor.utils.pytorch.module import infer_sequential_targets

    (
        CalibrationPipeline,
        SequentialPipeline,
        IntermediatesCache,
        handle_sequential_oom,
        trace,
        get_batches,
    ) = compat.sequential_pipeline_parts()

    @handle_sequential_oom
    def sequential_pass(model, dataloader, dataset_args, pass_index: int, checkpointer) -> None:
        session = active_session()
        resume = checkpointer.resume_at()
        if resume is not None and resume[0] > pass_index:
            # Finished before the crash: its lifecycle events still run, in the same order.
            LifecycleCallbacks.calibration_start()
            checkpointer.restore(model, pass_index)
            LifecycleCallbacks.calibration_end()
            return
        start = resume[1] if resume is not None and resume[0] == pass_index else 0

        onload_device = get_main_device()
        offload_device = torch.device(dataset_args.sequential_offload_device)
        set_onload_device(model, onload_device)
        modifiers = session.lifecycle.recipe.modifiers
        if any(type(m).__name__ == "AutoRoundModifier" for m in modifiers):
            dataset_args.propagate_error = False
        targets = infer_sequential_targets(model, dataset_args.sequential_targets)
        subgraphs = trace(
            model,
            next(iter(dataloader)),
            targets,
            dataset_args.tracing_ignore,
            dataset_args.sequential_targets_per_subgraph,
        )
        num_subgraphs = len(subgraphs)

        LifecycleCallbacks.calibration_start()
        # After calibration_start: it resets scales and may untie embeddings.
        checkpointer.restore(model, pass_index)
        with contextlib.ExitStack() as stack:
            stack.enter_context(calibration_forward_context(model))
            stack.enter_context(DisableQuantization(model))
            fresh = start == 0 or getattr(dataset_args, "use_loss_mask", False)
            from_data = (
                IntermediatesCache.from_dataloader(dataloader, onload_device, offload_device)
                if fresh
                else None
            )
            activations = (
                from_data
                if start == 0
                else checkpointer.activations(IntermediatesCache, onload_device, offload_device)
            )
            if getattr(dataset_args, "use_loss_mask", False):
                session.state.loss_masks = [
                    from_data.fetch(batch_idx, ["loss_mask"]).get("loss_mask")
                    for batch_idx in range(len(dataloader))
                ]
            else:
                session.state.loss_masks = None
            sequential_prefetch = getattr(dataset_args, "sequential_prefetch", False)
            session.state.sequential_prefetch = sequential_prefetch

            num_batches = len(dataloader)
            for subgraph_index in range(start, num_subgraphs):
                subgraph = subgraphs[subgraph_index]
                last = subgraph_index == num_subgraphs - 1
                position = f"({subgraph_index + 1}/{num_subgraphs})"
                with disable_offloading():
                    for batch_idx, inputs in get_batches(
                        activations,
                        num_batches,
                        subgraph.input_names,
                        f"{position}: Calibrating",
                        sequential_prefetch,
                    ):
                        session.state.current_batch_idx = batch_idx
                        outputs = subgraph.forward(model, **inputs)
                        if not dataset_args.propagate_error and not last:
                            activations.update(batch_idx, outputs)
                            activations.delete(batch_idx, subgraph.consumed_names)

                    LifecycleCallbacks.sequential_epoch_end(subgraph.submodules(model))

                    if dataset_args.propagate_error:
                        with HooksMixin.disable_hooks():
                            for batch_idx, inputs in get_batches(
                                activations,
                                num_batches,
                                subgraph.input_names,
                                f"{position}: Propagating",
                                sequential_prefetch,
                            ):
                                output = subgraph.forward(model, **inputs)
                                if not last:
                                    activations.update(batch_idx, output)
                                    activations.delete(batch_idx, subgraph.consumed_names)
                    # The subgraph is finished and the next one's inputs are complete.
                    checkpointer.subgraph_done(
                        model,
                        pass_index,
                        subgraph_index,
                        num_subgraphs,
                        subgraph.submodules(model),
                        activations,
                    )
            LifecycleCallbacks.calibration_end()

    @CalibrationPipeline.register(RESUMABLE_PIPELINE)
    class ResumablePipeline(CalibrationPipeline):
        @staticmethod
        def __call__(model, dataloader, dataset_args):
            checkpointer, independent = _resuming.get()
            session = active_session()
            modifiers = session.lifecycle.recipe.modifiers
            groups = [[m] for m in modifiers] if independent else [modifiers]
            pass_index = 0
            with patch_attr(session.lifecycle.recipe, "modifiers", None):
                for group in groups:
                    session.lifecycle.recipe.modifiers = group
                    pipeline = CalibrationPipeline.from_modifiers(group)
                    if isinstance(pipeline, SequentialPipeline):
                        sequential_pass(model, dataloader, dataset_args, pass_index, checkpointer)
                        pass_index += 1
                    else:  # data-free passes are cheap and run again
                        pipeline(model, dataloader, dataset_args)
