"""The model's modules by name, with their class names: what a recipe's targets are matched against.

From the safetensors headers where they tell enough (no torch: `X.weight` names module X, a 2-D
weight is a Linear layer or an embedding), else from the model built on the meta device from
its config. The recipe's order check (compressflow/recipes/order.py) takes the table as data.
"""

from __future__ import annotations

import re
from pathlib import Path

from compressflow.model.headers import tensor_index
from compressflow.model.tracing import meta_model
from compressflow.results import FetchedModel

# A 2-D weight under one of these names is an embedding, not a Linear layer.
_EMBEDDING = re.compile(r"(^|\.)(embed_tokens|embed_in|wte|word_embeddings|embeddings)$")

Modules = dict[str, tuple[str, ...]]


def header_modules(folder: Path) -> Modules:
    """Module name -> ("Linear",) / ("Embedding",) / () from the checkpoint's headers; empty
    when the folder holds no safetensors (a model fetched without its weights). The modules
    that hold them are listed too, with no class: a recipe may target a parent by name
    (SparseGPT's `re:.*layers.0$` prunes that decoder layer's Linear layers)."""
    modules: Modules = {}
    for tensor, info in tensor_index(folder).items():
        module, _, leaf = tensor.rpartition(".")
        if leaf != "weight" or not module:
            continue
        parts = module.split(".")
        for depth in range(1, len(parts)):
            modules.setdefault(".".join(parts[:depth]), ())
        if len(info.shape) != 2:
            modules[module] = ()
        else:
            modules[module] = ("Embedding",) if _EMBEDDING.search(module) else ("Linear",)
    return modules


def meta_modules(model: FetchedModel) -> tuple[Modules, str]:
    """Module name -> its class and base class names, and the model's class name, from the
    model built on the meta device (in a child: it imports torch and transformers)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    meta = meta_model(config, model.model_class, model.trust_remote_code)
    table = {
        name: tuple(cls.__name__ for cls in type(module).__mro__)
        for name, module in meta.named_modules()
    }
    return table, type(meta).__name__
