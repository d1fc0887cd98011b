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


def unloaded_tensors(folder, model_class: str, trust_remote_code: bool) -> set[str]:
    """Tensors of the checkpoint in `folder` that transformers does not load as weights of their
    own, so no checkpoint saved from the loaded model holds them (verify must not miss them).

    Decided as `from_pretrained` decides, on the meta model: names the class ignores on load,
    names that rename onto no parameter or persistent buffer (old Llamas' per-layer
    `rotary_emb.inv_freq`, `position_ids` now non-persistent), and tied copies (`lm_head.weight`
    saved beside the embeddings when the config ties them: loaded, then replaced by the tie).
    """
    import re
    from pathlib import Path

    from transformers import AutoConfig

    from compressflow.model.checkpoint import tensor_index

    names = set(tensor_index(Path(folder)))
    if not names:
        return set()
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    model = meta_model(config, model_class, trust_remote_code)
    kept = model.state_dict().keys() - set(model.all_tied_weights_keys)
    ignored = [re.compile(pattern) for pattern in compat.ignored_on_load(model)]
    return {
        name
        for name, loaded in compat.loaded_names(model, names).items()
        if loaded not in kept or any(pattern.search(loaded) for pattern in ignored)
    }


def outside_text_model(meta) -> list[str]:
    """Modules of a vision-language model that are not its language model: the vision tower and
    the projector, as the largest subtrees that hold an nn.Linear. [] for a text-only model.

    The language model is the submodule built from `config.get_text_config()`, found by that
    config, not by name; the output embeddings (`lm_head`) are the recipe's to ignore.
    """
    import torch

    text_config = meta.config.get_text_config()
    text = next((m for m in meta.modules() if getattr(m, "config", None) is text_config), meta)
    if text is meta:
        return []
    kept = {id(text), id(meta.get_output_embeddings())}
    found: list[str] = []

    def walk(module, prefix: str) -> None:
        for name, child in module.named_children():
            inside = {id(m) for m in child.modules()}
            if id(child) in kept:
                continue
            if inside & kept:  # an ancestor of the language model (`model`): look inside
                walk(child, f"{prefix}{name}.")
            elif any(isinstance(m, torch.nn.Linear) for m in child.modules()):
                found.append(f"{prefix}{name}")

    walk(meta, "")
    return found
