"""Folder checks of the folder and its files: the folder listable, every file the loaders open a
regular file this worker can read, every JSON file parsed. And `local_folder`: which local
folder, if any, `model_id` names.
"""

from __future__ import annotations

import json
import os
from fnmatch import fnmatch
from pathlib import Path

from compressflow.errors import ModelFetchError
from compressflow.limits import MAX_JSON_BYTES, not_regular, read_json
from compressflow.model.args import is_store_uri
from compressflow.model.download import HUB_CONFIG_PATTERNS
from compressflow.model.folder_checks import Folder, FolderCheck
from compressflow.params import ModelArgs

# Files of a model folder that fetch or the loaders open: those and the weights.
MODEL_FILES = [*HUB_CONFIG_PATTERNS, "*.safetensors"]


def refuse_irregular(file: Path) -> None:
    """Refuse a FIFO, device, folder or broken link where the model's files hold a file."""
    if kind := not_regular(file):
        raise ModelFetchError(
            "model.model_id",
            f"{file} is {kind}, not a regular file",
            f"replace {file.name} with the model's real file, or remove it",
        )


def check_files(path: Path) -> None:
    """Refuse a FIFO, device, folder or broken link named as a file the loaders read: opening
    it would block forever, never end, or fail as an OSError the task retries. And one this
    process may not read: the loaders would fail on it after the forkserver's imports."""
    for file in sorted(path.iterdir()):
        if not any(fnmatch(file.name, pattern) for pattern in MODEL_FILES):
            continue
        refuse_irregular(file)
        try:
            file.open("rb").close()  # a regular file: the open cannot block
        except OSError as exc:
            raise ModelFetchError(
                "model.model_id",
                f"{file} cannot be read by this worker ({exc.strerror})",
                f"make {file.name} readable by the user the worker runs as (chmod a+r), or copy "
                "the model to a folder that user owns",
            ) from None


def load_model_json(file: Path):
    """A JSON file of the model's (config.json, the shard index), its parse errors worded; a key
    given twice in one object with two different values is refused (read_json)."""
    try:
        return read_json(file, "model.model_id", ModelFetchError)
    except ModelFetchError:  # read_json's own refusal (a key given twice, too deep): a ValueError
        raise
    except json.JSONDecodeError as exc:  # transformers would fail later with no file or field
        raise ModelFetchError(
            "model.model_id",
            f"{file} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}",
            f"fix {file.name} at that position, or download the model again",
        ) from None
    except UnicodeDecodeError:
        raise not_utf8(file) from None
    except ValueError as exc:  # e.g. an integer longer than Python converts (4,300 digits)
        raise ModelFetchError(
            "model.model_id",
            f"{file} cannot be read as JSON: {exc}",
            f"replace {file.name} with the model's original",
        ) from None


# JSON files a loader reads as an object of settings (config.json: check_config).
JSON_OBJECTS = (
    "generation_config.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "chat_template.json",
    "model.safetensors.index.json",
)
# Files whose `auto_map` makes a loader import the repository's own code (config.json's:
# check_config).
REMOTE_CODE_FILES = (
    "tokenizer_config.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)


def local_folder(args: ModelArgs) -> Path | None:
    """The local folder `model_id` names, resolved; None for a hub or ClearML id. A path that
    does not exist (it starts with ., / or ~, or holds //) is refused, not sent to the hub. A
    store URI (s3://, file://) is no local folder: it is downloaded first."""
    if args.clearml_model or is_store_uri(args.model_id):
        return None
    path = Path(args.model_id).expanduser()
    if path.exists():
        return path.resolve()
    if args.model_id.startswith((".", "/", "~")) or os.sep * 2 in args.model_id:
        raise ModelFetchError(
            "model.model_id",
            f"local folder {args.model_id} does not exist",
            "fix the path (relative paths are resolved from the worker's working directory)",
        )
    return None


def check_readable(path: Path) -> None:
    """Refuse a model_id that is not a folder this process can list."""
    if not path.is_dir():
        raise ModelFetchError(
            "model.model_id",
            f"{path} is {not_regular(path) or 'a file'}, not a model folder",
            "point model_id at the folder that holds config.json and the weights",
        )
    try:
        next(path.iterdir(), None)
    except OSError as exc:
        raise ModelFetchError(
            "model.model_id",
            f"the folder {path} cannot be listed by this worker ({exc.strerror})",
            "make it readable by the user the worker runs as (chmod a+rx), or copy the model to "
            "a folder that user owns",
        ) from None


def _json_ends(file: Path) -> None:
    """A JSON file past the cap on what is parsed here (a large tokenizer.json): refused only
    when it is cut off, which its first and last bytes show."""
    with file.open("rb") as handle:
        first = handle.read(64).lstrip()[:1]
        handle.seek(max(0, file.stat().st_size - 64))
        last = handle.read().rstrip()[-1:]
    if (first, last) not in ((b"{", b"}"), (b"[", b"]")):
        raise ModelFetchError(
            "model.model_id",
            f"{file} is not valid JSON: it is cut off (it ends in {last!r}, not a closing bracket)",
            f"replace {file.name} with the model's original, or download the model again",
        )


def check_json_files(path: Path) -> dict[str, dict]:
    """Refuse a JSON file of the folder that does not parse, or a loader's settings file that is
    not an object; returns the parsed settings files that other checks read (REMOTE_CODE_FILES,
    chat_template.json). config.json is check_config's."""
    kept: dict[str, dict] = {}
    for file in sorted(path.glob("*.json")):
        if file.name == "config.json":
            continue
        if file.stat().st_size > MAX_JSON_BYTES:
            _json_ends(file)
            continue
        data = load_model_json(file)
        if file.name in JSON_OBJECTS and not isinstance(data, dict):
            raise ModelFetchError(
                "model.model_id",
                f"{file} holds a JSON {type(data).__name__}, not an object of settings",
                f"replace {file.name} with the model's original, or download the model again",
            )
        if file.name in (*REMOTE_CODE_FILES, "chat_template.json"):
            kept[file.name] = data
    return kept


def _json(folder: Folder) -> None:
    folder.settings = check_json_files(folder.path)


READABLE = FolderCheck("readable", "model.model_id", lambda folder: check_readable(folder.path))
FILES = FolderCheck("files", "model.model_id", lambda folder: check_files(folder.path))
JSON = FolderCheck("json", "model.model_id", _json)


def not_utf8(file: Path) -> ModelFetchError:
    """The refusal of a text file of the model's (JSON, a template) that is not UTF-8."""
    return ModelFetchError(
        "model.model_id",
        f"{file} is not UTF-8 text",
        f"replace {file.name} with the model's original",
    )
