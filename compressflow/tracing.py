"""Models on the meta device, and torch left as it was after llm-compressor's tracer.

Shared by the traceability check (which traces a weightless model before anything loads) and
calibration (whose sequential pipeline traces the real one).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from compressflow.errors import TraceabilityError


@contextmanager
def restored_torch_functions() -> Iterator[None]:
    """Put back the torch state llm-compressor's tracer changes, however the trace ends.

    In 0.14.0.1 `HFTracer.patch_for_tracing` restores the torch functions it wraps after a
    successful trace only: a failed one leaves `torch.arange`, `torch.zeros`... wrapped for the
    rest of the process, and every model built afterwards gets garbage rotary frequencies (NaN
    logits). And the tracer registers each traced forward's namespace, which holds the model,
    in torch.fx's module-level `_wrapped_fns_to_patch`, which nothing clears: the calibrated
    model would stay in memory beside the checkpoint verify reloads.
    """
    import torch
    import torch.fx._symbolic_trace as symbolic_trace
    from llmcompressor.pipelines.sequential.transformers_helpers import HFTracer

    originals = {name: getattr(torch, name) for name in HFTracer._TORCH_METHODS_TO_PATCH}
    wrapped = dict(symbolic_trace._wrapped_fns_to_patch)
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(torch, name, function)
        symbolic_trace._wrapped_fns_to_patch.clear()
        symbolic_trace._wrapped_fns_to_patch.update(wrapped)


def meta_model(config, model_class: str = "AutoModelForCausalLM", trust_remote_code: bool = False):
    """`config`'s model on the meta device: every module and shape, no weights in memory."""
    import transformers
    from accelerate import init_empty_weights

    cls = getattr(transformers, model_class, None)
    if cls is None:
        raise TraceabilityError(
            "model.model_class",
            f"'{model_class}' is not a transformers class",
            "use one such as AutoModelForCausalLM",
        )
    with init_empty_weights():
        if hasattr(cls, "from_config"):  # an Auto class: it resolves the concrete class
            return cls.from_config(config, trust_remote_code=trust_remote_code)
        return cls._from_config(config)  # a concrete class: the config already names its code
