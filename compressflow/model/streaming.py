"""Streaming: a model whose weights stay in its checkpoint's safetensors files; each module reads
its own parameters when it runs and drops them when it returns.

For the passes that only read a large checkpoint (the reference logits of a model-free run, and
verify's one pass over its output): transformers' `from_pretrained` with every weight left on
disk still reads each tensor once while loading (measured: 1.00 x the checkpoint's bytes before
the first forward), so a load then a forward read the checkpoint twice. Built on the meta device,
the model reads it once per forward, and holds one module's weights at a time.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

from compressflow.errors import InputError, first_line
from compressflow.logs import run_logger
from compressflow.model.headers import tensor_index
from compressflow.model.loading import check_loads_completely
from compressflow.model.shards import loaded_files
from compressflow.results import FetchedModel

# safetensors' dtype names, for the dtype the model is built in (its buffers, its masks)
DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def streamed_model(model: FetchedModel, folder: Path):
    """`built_streamed`, or None with a warning when building it failed (remote code that cannot
    build on the meta device, a config transformers reads only while loading): streaming only
    saves reads, and the caller then loads the model as it always could. A checkpoint that lacks
    a tensor the model needs is refused as loading it would be (`check_loads_completely`)."""
    try:
        return built_streamed(model, folder)
    except InputError:  # the checkpoint lacks what the model needs: loading it would refuse too
        raise
    except Exception as exc:  # noqa: BLE001 - any failure: the caller loads the model instead
        run_logger(__name__).warning(
            "Cannot stream %s's weights (%s); loading it instead",
            model.model_id,
            first_line(exc),
        )
        return None


def built_streamed(model: FetchedModel, folder: Path):
    """`model.model_class` built on the meta device over `folder`'s checkpoint, each module
    reading its parameters from there when called; None when transformers must convert the
    checkpoint while loading it: a parameter with no float tensor of its shape under its name or
    a tied twin's (renamed or fused on load), float tensors of several dtypes (cast on load), or
    a quantized checkpoint (its quantizer builds other modules). Load it with transformers then.

    A model whose code reads another module's weights outside that module's call computes on
    meta tensors and fails; callers fall back to loading it with transformers. Persistent buffers
    (DeepSeek-V3's router bias) are read from the checkpoint once, as loading does.
    """
    import torch
    import transformers
    from accelerate import init_empty_weights
    from safetensors import safe_open

    files = set(loaded_files(folder))  # what loading reads: a file beside them is not the model's
    index = {name: info for name, info in tensor_index(folder).items() if info.file in files}
    floats = {DTYPES[info.dtype] for info in index.values() if info.dtype in DTYPES}
    if len(floats) != 1:  # mixed: transformers casts them to one dtype while loading
        return None
    dtype = getattr(torch, floats.pop())
    config = transformers.AutoConfig.from_pretrained(
        folder, trust_remote_code=model.trust_remote_code
    )
    if getattr(config, "quantization_config", None):
        return None
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with init_empty_weights(include_buffers=False):  # buffers (rotary tables) are computed
            cls = getattr(transformers, model.model_class)
            if model.model_class.startswith("Auto"):
                built = cls.from_config(config, trust_remote_code=model.trust_remote_code)
            else:
                built = cls(config)
    finally:
        torch.set_default_dtype(default)
    built.tie_weights()  # from_pretrained ties them; construction alone does not for every model
    check_loads_completely(model, folder)  # a tensor it needs and the files lack: refused
    aliases = defaultdict(list)  # tied parameters are one object under several names
    for name, parameter in built.named_parameters(remove_duplicate=False):
        aliases[id(parameter)].append(name)
    owners = []
    for prefix, module in built.named_modules():
        own = {}
        for attribute, parameter in module.named_parameters(recurse=False):
            keys = [f"{prefix}.{attribute}".lstrip("."), *aliases[id(parameter)]]
            key = next((k for k in keys if k in index), None)
            if key is None or not fits(index[key], parameter):
                return None
            own[attribute] = (key, parameter)
        if own:
            owners.append((module, own))
    parameters = {name for name, _ in built.named_parameters(remove_duplicate=False)}
    for name, buffer in built.state_dict().items():
        if name in parameters:
            continue
        if name not in index or tuple(index[name].shape) != tuple(buffer.shape):
            return None  # renamed or reshaped on load
        with safe_open(str(index[name].file), framework="pt") as handle:
            buffer.copy_(handle.get_tensor(name))
    # A tensor two modules use (tied embeddings and head) is kept after its first read.
    shared = {
        k for k, n in Counter(k for _, own in owners for k, _ in own.values()).items() if n > 1
    }
    kept = {}

    def read(name: str):
        if name in kept:
            return kept[name]
        # Opened per read, as compressed-tensors' disk cache does: a file left open keeps every
        # page read through its memory map resident, the whole checkpoint by the pass's end.
        with safe_open(str(index[name].file), framework="pt") as handle:
            tensor = handle.get_tensor(name)
        if name in shared:
            kept[name] = tensor
        return tensor

    for module, own in owners:
        module.register_forward_pre_hook(lambda m, _, own=own: onload(m, own, read))
        module.register_forward_hook(lambda m, _, out, own=own: offload(m, own, out))
    return built.eval()


def fits(info, parameter) -> bool:
    """The checkpoint's tensor can stand in for `parameter` as it is read: same shape, a float."""
    return info.dtype in DTYPES and tuple(info.shape) == tuple(parameter.shape)


def onload(module, own: dict, read) -> None:
    import torch

    for attribute, (key, _) in own.items():
        setattr(module, attribute, torch.nn.Parameter(read(key), requires_grad=False))


def offload(module, own: dict, output):
    for attribute, (_, meta) in own.items():
        setattr(module, attribute, meta)
    return output
