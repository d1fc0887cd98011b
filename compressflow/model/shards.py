"""A checkpoint's shard index: the files a loader reads, and which shard holds each tensor.

Read by the folder checks (folder_checks/weights.py holds the index to its shards), by the
loaders (loading.py, streaming.py) and in the messages that list what they found.
"""

from __future__ import annotations

from pathlib import Path

from compressflow.errors import ModelFetchError
from compressflow.model.folder_checks.files import load_model_json


def shard_names(index: Path) -> set[str]:
    """The shard files model.safetensors.index.json lists in its `weight_map`."""
    return set(weight_map_of(index).values())


def weight_map_of(index: Path) -> dict[str, str]:
    """model.safetensors.index.json's `weight_map`: tensor name -> shard file, each file a path
    inside the index's folder (transformers joins it to the folder: `../x` or `/x` would read
    another model's file)."""
    data = load_model_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(shard, str) for shard in weight_map.values()
    ):
        raise ModelFetchError(
            "model.model_id",
            f'{index} is not a shard index: it needs a "weight_map" object of tensor names to '
            "shard file names",
            f"replace {index.name} with the model's original, or download the model again",
        )
    outside = sorted({shard for shard in weight_map.values() if not inside_folder(shard)})
    if outside:
        raise ModelFetchError(
            "model.model_id",
            f"{index} names {len(outside)} shard file(s) that are not files inside "
            f"{index.parent}: {named(outside)}",
            f"replace {index.name} with the model's original: its weight_map names the shard "
            "files beside it (model-00001-of-00002.safetensors)",
        )
    return weight_map


def inside_folder(name: str) -> bool:
    """`name` is a relative path that stays inside the folder it is joined to."""
    parts = name.split("/")
    return (
        bool(name)
        and not name.startswith("/")
        and "\\" not in name
        and "\0" not in name
        and ":" not in parts[0]  # a Windows drive: c:x
        and all(part not in ("", ".", "..") for part in parts)
    )


def named(names, limit: int = 3) -> str:
    """The first `limit` of `names` and how many more: "['a', 'b', 'c'] and 4 more"."""
    names = list(names)
    return f"{names[:limit]}{and_more(names, limit)}"


def and_more(names: list, shown: int = 3) -> str:
    """The end of a message that lists `shown` of `names`: " and N more", or nothing."""
    return f" and {len(names) - shown} more" if len(names) > shown else ""


def loaded_files(folder: Path) -> list[Path]:
    """The safetensors files `from_pretrained` reads `folder`'s weights from: model.safetensors,
    else every file the shard index names (all of each file's tensors, whatever the index says
    of them), else none (no safetensors checkpoint transformers would find)."""
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / shard for shard in sorted(shard_names(index))]
    return []
