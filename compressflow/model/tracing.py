"""Models on the meta device: every module and shape of a model, no weights in memory.

Used by the traceability check, the memory plan and the checks that run before anything loads.
"""

from __future__ import annotations

from compressflow import compat
from compressflow.errors import TraceabilityError


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
        return compat.model_from_config(
            cls, config
        )  # a concrete class: the config already names its code
