"""Folder checks of the weights: none held only as pickle files, every safetensors file whole, and
the shard index saying exactly what the shards hold.
"""

from __future__ import annotations

from pathlib import Path

from compressflow.errors import ModelFetchError
from compressflow.model.folder_checks import Folder, FolderCheck
from compressflow.model.folder_checks.files import load_model_json
from compressflow.model.headers import HeaderError, read_header
from compressflow.model.shards import and_more, named, shard_names, weight_map_of

# Weights torch.load unpickles: loading one of unknown origin can execute the code it carries
# (transformers' own refusal even suggests weights_only=False, the one thing never to do).
PICKLE_WEIGHTS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")


def check_pickle_weights(path: Path) -> None:
    """Refuse weights held only as pickle files: loading one runs torch.load on a file of
    unknown origin. With safetensors beside them the loaders read the safetensors."""
    if next(path.glob("*.safetensors"), None):
        return
    pickles = sorted({file.name for pattern in PICKLE_WEIGHTS for file in path.glob(pattern)})
    if not pickles:
        return
    convert = (
        'python -c "import sys; from transformers import AutoModelForCausalLM as M, '
        "AutoTokenizer as T; s, d = sys.argv[1:]; M.from_pretrained(s).save_pretrained(d); "
        f'T.from_pretrained(s).save_pretrained(d)" {path} {path}-safetensors'
    )
    raise ModelFetchError(
        "model.model_id",
        f"{path} holds its weights only as pickle files ({', '.join(pickles[:3])}"
        f"{', ...' if len(pickles) > 3 else ''}): loading them runs torch.load, which can "
        "execute code the file carries",
        f"convert them to safetensors once, where you trust the files: `{convert}` (transformers "
        "reads them with torch.load(weights_only=True), the mode that executes nothing; never "
        "switch that off), then set model_id to the new folder",
    )


# The weights files every loader looks for; config.json's `transformers_weights` may name another
# for transformers alone.
STANDARD_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def check_index(path: Path) -> None:
    """Refuse a sharded checkpoint whose index and shards disagree about where a tensor lives.

    transformers loads every tensor of each file the index names and no other: a tensor the index
    places in a file that lacks it is loaded from nowhere when no file it reads holds it (fresh
    random values, and only a warning), and vLLM and model-free quantization read the files by
    other rules. The index must say exactly what the shards hold: each tensor in the shard it
    names, each shard's tensors listed under that shard, no tensor in two shards. Nor may
    config.json name another weights file for transformers alone (`transformers_weights`).
    """
    config = path / "config.json"
    settings = load_model_json(config) if config.is_file() else {}
    named_file = settings.get("transformers_weights") if isinstance(settings, dict) else None
    if named_file is not None and named_file not in STANDARD_WEIGHTS:
        raise ModelFetchError(
            "model.model_id",
            f"{config} names its weights file (transformers_weights: {named_file!r:.200}): "
            "transformers would load that, while vLLM and model-free quantization read "
            f"{' or '.join(STANDARD_WEIGHTS)}",
            "delete transformers_weights from config.json and keep the weights as "
            "model.safetensors (or shards and model.safetensors.index.json)",
        )
    index = path / "model.safetensors.index.json"
    files = sorted(file.name for file in path.glob("*.safetensors"))
    if files and "model.safetensors" not in files and not index.exists():
        raise ModelFetchError(
            "model.model_id",
            f"{path} holds {named(files)} but neither model.safetensors nor {index.name}: "
            "transformers finds no weights in it",
            "name a single-file checkpoint model.safetensors, or add the shard index its "
            "conversion wrote (model.safetensors.index.json)",
        )
    if not index.exists():
        return
    weight_map = weight_map_of(index)
    fix = (
        "the index and the shards come from different downloads or were edited: download the "
        "model again (delete the folder, or its hub cache folder under HF_HOME, first), or "
        "rebuild the index's weight_map from the shards' own tensor names"
    )
    shards = sorted(set(weight_map.values()))
    if not shards:  # transformers then loads no file at all, and fails with an IndexError
        raise ModelFetchError(
            "model.model_id",
            f"{index} lists no tensors (its weight_map is empty), so transformers would load "
            f"none of the weights files beside it ({named(files) if files else 'none'})",
            fix,
        )
    if (path / "model.safetensors").exists() and shards != ["model.safetensors"]:
        raise ModelFetchError(
            "model.model_id",
            f"{path} holds two checkpoints: model.safetensors and the {len(shards)} shard(s) "
            f"{index.name} lists ({named(shards)}); transformers loads model.safetensors alone, "
            "model-free quantization and vLLM read the shards too",
            "keep one of them: delete model.safetensors, or the shards and their index, as the "
            "model's repository has it",
        )
    held: dict[str, list[str]] = {}  # tensor -> the shards that hold it
    for shard in shards:
        try:
            _, tensors = read_header(path / shard)
        except HeaderError as exc:
            raise ModelFetchError(
                "model.model_id", f"{path / shard} is not a readable safetensors file: {exc}", fix
            ) from None
        for name in tensors:
            if name != "__metadata__":
                held.setdefault(name, []).append(shard)
    misplaced = [name for name, shard in weight_map.items() if shard not in held.get(name, ())]
    if misplaced:
        others = {}  # files beside the shards the index does not list: only to say where
        for file in sorted(path.glob("*.safetensors")):
            if file.name not in shards:
                try:
                    others.update(dict.fromkeys(read_header(file)[1], file.name))
                except HeaderError:
                    continue

        def found(name: str) -> str:
            if name in held:
                return f"it is in {held[name][0]}"
            if name in others:
                return f"it is in {others[name]}, which the index does not list"
            return "no file holds it"

        where = [f"{name} in {weight_map[name]} ({found(name)})" for name in misplaced[:3]]
        raise ModelFetchError(
            "model.model_id",
            f"{index} places {len(misplaced)} tensor(s) in shards that do not hold them: "
            f"{'; '.join(where)}{and_more(misplaced)}; a loader that follows the index misses "
            "them, and transformers, which reads only the files the index lists, fills one it "
            "finds in none of them with random values",
            fix,
        )
    twice = [name for name, holders in held.items() if len(holders) > 1]
    if twice:
        where = [f"{name} in {held[name]}" for name in twice[:3]]
        raise ModelFetchError(
            "model.model_id",
            f"{len(twice)} tensor(s) are in more than one shard of {path}: {'; '.join(where)}"
            f"{and_more(twice)}; which copy loads depends on the loader",
            fix,
        )
    unlisted = [name for name in held if name not in weight_map]
    if unlisted:
        where = [f"{name} (in {held[name][0]})" for name in unlisted[:3]]
        raise ModelFetchError(
            "model.model_id",
            f"{index} does not list {len(unlisted)} tensor(s) its shards hold: "
            f"{'; '.join(where)}{and_more(unlisted)}",
            fix,
        )


def check_has_weights(path: Path) -> None:
    """Refuse a folder without a safetensors file, where a model is read now (not validated
    ahead of a fetch of its weights): transformers says only that it found no file to load."""
    if not any(path.glob("*.safetensors")):
        raise ModelFetchError(
            "model.model_id",
            f"{path} holds no weights: no .safetensors file",
            "point model_id at the folder that holds the model's weights, or publish or "
            "download it again",
        )


def check_weight_files(path: Path) -> set[str]:
    """Refuse truncated or corrupt safetensors (an interrupted download) by their headers alone;
    returns the names of the tensors they hold.

    A safetensors file is an 8-byte header length, a JSON header giving each tensor's byte range,
    then the data: a file shorter than its header says is cut off, whatever loads it later.
    """
    fix = (
        "download the model again (delete the file, or its hub cache folder under HF_HOME, "
        "first), or restore it from where it was copied"
    )
    index = path / "model.safetensors.index.json"
    if index.exists():
        missing = sorted(name for name in shard_names(index) if not (path / name).is_file())
        if missing:
            raise ModelFetchError(
                "model.model_id", f"{path} lacks shards its index lists: {missing[:3]}", fix
            )
    names: set[str] = set()
    for file in sorted(path.glob("*.safetensors")):
        try:
            length, tensors = read_header(file)
        except HeaderError as exc:
            raise ModelFetchError(
                "model.model_id", f"{file} is not a readable safetensors file: {exc}", fix
            ) from None
        size = file.stat().st_size
        end = max(
            (spec["data_offsets"][1] for name, spec in tensors.items() if name != "__metadata__"),
            default=0,
        )
        if 8 + length + end > size:
            raise ModelFetchError(
                "model.model_id",
                f"{file} is truncated: its header describes {8 + length + end:,} bytes, the file "
                f"has {size:,}",
                fix,
            )
        if 8 + length + end < size:  # safetensors: "incomplete metadata, file not fully covered"
            raise ModelFetchError(
                "model.model_id",
                f"{file} is not a readable safetensors file: {size - 8 - length - end:,} bytes "
                "follow the last tensor its header describes",
                fix,
            )
        names.update(name for name in tensors if name != "__metadata__")
    check_index(path)
    return names


def _weight_files(folder: Folder) -> None:
    folder.names = check_weight_files(folder.path)


PICKLES = FolderCheck(
    "pickle weights",
    "model.model_id",
    lambda folder: check_pickle_weights(folder.path),
    weights=True,
)
WEIGHT_FILES = FolderCheck("weight files", "model.model_id", _weight_files, weights=True)
