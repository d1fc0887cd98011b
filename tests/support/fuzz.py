"""The fuzzer (issue 39): inputs nobody here wrote, as a tired user or an attacker hands them to
compress-model, and the one property every case is held to.

Nine kinds of input, one Hypothesis strategy each (`checkpoint_cases`, `tokenizer_cases`,
`recipe_cases`, `data_cases`, `output_cases`, the worker's environment: `settings_cases`, the
output a rerun finds already published, changed since: `published_cases`, which also go to
evaluate-model as `compressed`: `run_evaluated`, where the output is uploaded: `upload_cases`,
`run_upload`, and a model read from object storage: `store_source_cases`).
A case is a frozen dataclass whose repr is the Python that builds it, so a case the fuzzer found is pasted into an `@example(...)` as printed.
`Case.prepare(env, root)` applies it to fresh copies in `root`, a folder of its own (the shared
models in `FuzzEnv` are never mutated), and returns the parameter groups to call the flow with.

The property, `assert_refused_or_sound`: the call either raises a CompressflowError whose field,
problem and fix are non-empty and whose message holds no traceback and no "weights_only=False",
within the time allowed, having written nothing (the case's folder hashes the same before and
after: no output, no staging leftovers, the source byte-for-byte unchanged); or it passes. An
exception of any other type is a finding; so is a refusal that calls an input's fault a defect
of compressflow's. A pydantic ValidationError passes only when `validate`'s own check of the
parameter groups raised it (the CLI prints that as field, problem and fix).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import io
import json
import os
import shutil
import stat
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import yaml
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from compressflow.errors import CompressflowError, QualityThresholdExceeded
from compressflow.registries.presets import PRESETS

# ---------------------------------------------------------------- the property

# `validate` runs every pre-calibration check without weights: about 0.6 s here for a valid
# tiny model once its children's forkserver is up. 10 s is that times 15, room for a 2-core
# machine four people share, and still a quarter of the 40 s issue 39 measured for checks
# waiting behind the forkserver's imports; a check that reads weights or calibrates takes longer.
VALIDATE_SECONDS = 10.0
# The whole flow refuses an input before calibration, or after it when verify catches it; its
# bound is only against a hang.
COMPRESS_SECONDS = 300.0
# What a user must never read in an error: a library's raw traceback, and the one advice that
# turns an untrusted pickle into code execution.
FORBIDDEN_WORDS = ("Traceback (most recent call last)", "weights_only=False")
# Our own source folders (the installed package maps flows/, tasks/, blocks/ into it).
OUR_CODE = tuple(
    str(Path(__file__).resolve().parents[2] / part) + os.sep
    for part in ("compressflow", "flows", "tasks", "blocks")
)


@dataclass
class Outcome:
    """What a call did: its error (None when it passed), its result and how long it took."""

    error: BaseException | None
    result: Any
    seconds: float

    @property
    def refused(self) -> bool:
        return self.error is not None


def snapshot(folder: Path) -> dict[str, str]:
    """Every entry under `folder`, links not followed, special files never opened: relative
    path -> its content hash, link target or kind."""
    if not os.path.lexists(folder):
        return {}
    found: dict[str, str] = {}
    for place, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(place, name)
            relative = os.path.relpath(path, folder)
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                found[relative] = "link:" + os.readlink(path)
            elif stat.S_ISDIR(mode):
                found[relative] = "dir"
            elif stat.S_ISREG(mode):
                digest = hashlib.sha256()
                with open(path, "rb") as handle:
                    for block in iter(lambda h=handle: h.read(1 << 20), b""):
                        digest.update(block)
                found[relative] = digest.hexdigest()
            else:
                found[relative] = f"special:{stat.S_IFMT(mode)}"
    return found


def _schema_refusal(error: BaseException) -> bool:
    """A pydantic ValidationError raised by `validate`'s own check of the parameter groups."""
    from pydantic import ValidationError

    if not isinstance(error, ValidationError):
        return False
    ours = [
        frame
        for frame in traceback.extract_tb(error.__traceback__)
        if frame.filename.startswith(OUR_CODE) and not frame.filename.endswith("params.py")
    ]
    return bool(ours) and ours[-1].filename.endswith("validate.py") and ours[-1].name == "validate"


def is_defect(error: CompressflowError) -> bool:
    """An error that names a stage as compressflow's defect (the error boundary's), not an input."""
    return "defect" in type(error).__name__.lower()


def check_refusal(case: Any, error: BaseException) -> None:
    """The refusal is ours, in our format, and says nothing a user must not read."""
    if _schema_refusal(error):
        return
    assert isinstance(error, CompressflowError), (
        f"{case!r}: {type(error).__name__} escaped instead of a CompressflowError: "
        f"{str(error)[:600]}\n{''.join(traceback.format_exception(error))[-3000:]}"
    )
    assert not is_defect(error), f"{case!r}: an input's fault reported as a defect: {error}"
    for part in ("field", "problem", "fix"):
        value = getattr(error, part)
        assert isinstance(value, str) and value.strip(), f"{case!r}: empty {part}: {error}"
    for words in FORBIDDEN_WORDS:
        assert words not in str(error), f"{case!r}: the message holds {words!r}: {error}"


def assert_refused_or_sound(
    call: Callable[[], Any],
    case: Any,
    watched: list[Path],
    seconds: float = VALIDATE_SECONDS,
    absent: list[Path] = (),
) -> Outcome:
    """Run `call`; hold it to the property (module docstring). `watched` folders (the case's
    own folder, every source it reads) must hash the same after the call, and the `absent`
    paths, outside them, must not exist; a passing call is held to the same unless the caller
    checks what it published itself (`assert_refused_or_published`)."""
    before = {folder: snapshot(folder) for folder in watched}
    absent = [path for path in absent if not os.path.lexists(path)]
    started = time.perf_counter()
    try:
        result, error = call(), None
    except Exception as exc:  # the property judges every exception
        result, error = None, exc
    outcome = Outcome(error, result, time.perf_counter() - started)
    if error is not None:
        check_refusal(case, error)
    assert outcome.seconds < seconds, (
        f"{case!r}: took {outcome.seconds:.1f} s, over {seconds:.0f} s: {error or 'passed'}"
    )
    for folder, hashed in before.items():
        after = snapshot(folder)
        changed = sorted(set(hashed.items()) ^ set(after.items()))
        assert not changed, f"{case!r}: {folder} changed: {changed[:6]} ({error or 'passed'})"
    for path in absent:
        assert not os.path.lexists(path), f"{case!r}: {path} was written ({error or 'passed'})"
    return outcome


# ---------------------------------------------------------------- the shared inputs


@dataclass
class FuzzEnv:
    """What cases copy from, built once per module; never mutated itself."""

    tmp: Path  # every case's own folder lies here
    single: Path  # the tiny Llama, one model.safetensors
    sharded: Path  # the same tensors in two shards with an index
    donors: dict[str, Path]  # other tiny architectures, for swaps
    shared: Path  # a copy the recipe, data and output cases read (hashed around every call)
    messages: Path  # a valid chat-messages .jsonl
    # A torch checkpoint that needs weights_only=False (an unlisted global).
    pickle_bytes: bytes = field(repr=False)
    # A finished compress run (conftest's SharedRun) whose output PublishedCase copies: set by
    # the tests that draw those cases.
    published: Any = field(default=None, repr=False)

    @classmethod
    def build(cls, tiny_model: Path, zoo_root: Path, tmp: Path, donors=("qwen3", "gpt_neox")):
        from compressflow.demo.zoo import build_tiny

        tmp.mkdir(parents=True, exist_ok=True)
        shared = tmp / "shared-model"
        if not shared.exists():
            shutil.copytree(tiny_model, shared)
        sharded = tmp / "sharded-model"
        if not sharded.exists():
            write_sharded(tiny_model, sharded)
        messages = tmp / "messages.jsonl"
        rows = [
            {
                "messages": [
                    {"role": "user", "content": f"Question {i}?"},
                    {"role": "assistant", "content": f"Answer {i}."},
                ]
            }
            for i in range(32)
        ]
        messages.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return cls(
            tmp=tmp,
            single=tiny_model,
            sharded=sharded,
            donors={name: build_tiny(name, zoo_root) for name in donors},
            shared=shared,
            messages=messages,
            pickle_bytes=unsafe_torch_pickle(),
        )


def unsafe_torch_pickle() -> bytes:
    """A torch.save file whose load needs a global torch's weights_only unpickler refuses (its
    refusal advises weights_only=False); the global is harmless if something loads it anyway."""
    import argparse

    import torch

    buffer = io.BytesIO()
    torch.save(
        {"model.embed_tokens.weight": torch.zeros(2, 2), "args": argparse.Namespace()}, buffer
    )
    return buffer.getvalue()


def read_safetensors(file: Path) -> tuple[dict, bytes]:
    """(header, data section) of a safetensors file, read as bytes."""
    raw = file.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def write_safetensors(file: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """name -> (dtype, shape, bytes) as a safetensors file, written without torch."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset, chunks = 0, []
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
        chunks.append(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(chunks))


def tensors_of(folder: Path) -> dict[str, bytes]:
    """Every tensor of a folder's safetensors files as its dtype, shape and bytes, whichever file."""
    found = {}
    for file in sorted(folder.glob("*.safetensors")):
        header, data = read_safetensors(file)
        for name, spec in header.items():
            if name != "__metadata__":
                begin, end = spec["data_offsets"]
                found[name] = json.dumps([spec["dtype"], spec["shape"]]).encode() + data[begin:end]
    return found


SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def write_sharded(source: Path, target: Path) -> None:
    """`source` (one model.safetensors) as two shards and model.safetensors.index.json, as
    save_pretrained writes a larger model: layer 0 and the embeddings in the first shard."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors"))
    header, data = read_safetensors(source / "model.safetensors")
    parts: list[dict] = [{}, {}]
    weight_map = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        shard = 0 if ("layers.0." in name or "embed" in name) else 1
        begin, end = spec["data_offsets"]
        parts[shard][name] = (spec["dtype"], spec["shape"], data[begin:end])
        weight_map[name] = SHARDS[shard]
    for name, part in zip(SHARDS, parts, strict=True):
        write_safetensors(target / name, part)
    index = {"metadata": {"total_size": len(data)}, "weight_map": dict(sorted(weight_map.items()))}
    (target / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


@contextmanager
def case_folder(env: FuzzEnv) -> Iterator[Path]:
    """A fresh folder for one case, removed after it (read-only folders made writable first)."""
    root = Path(tempfile.mkdtemp(prefix="case-", dir=env.tmp))
    try:
        yield root
    finally:
        for place, dirs, _ in os.walk(root):
            for name in dirs:
                path = os.path.join(place, name)
                if not os.path.islink(path):
                    os.chmod(path, 0o755)
        os.chmod(root, 0o755)
        shutil.rmtree(root, ignore_errors=True)


def validate_params(model: Path | str, root: Path, **groups: dict) -> dict[str, dict]:
    """validate's parameter groups: the tiny model's quick defaults, `groups` merged in."""
    base = {
        "model": {"model_id": str(model)},
        "dataset": {"dataset_name": "python_docs", "text_samples": 8, "max_seq_len": 64},
        "recipe": {"recipe": "W4A16"},
        "output": {"save_directory": str(root / "out")},
    }
    merged = {name: {**value, **groups.get(name, {})} for name, value in base.items()}
    return {**merged, **{name: value for name, value in groups.items() if name not in base}}


# ---------------------------------------------------------------- file mutations

DELETE = "__delete__"  # EditJson's value that removes the key


def _set_path(data: Any, path: str, value: Any) -> Any:
    """`data` with the dotted `path` set to `value` (DELETE removes it); '' is the whole document."""
    if not path:
        return value
    keys = path.split(".")
    node = data
    for key in keys[:-1]:
        if not isinstance(node, dict):
            return data
        node = node.setdefault(key, {})
    if isinstance(node, dict):
        if value == DELETE:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = value
    return data


@dataclass(frozen=True)
class Remove:
    file: str

    def apply(self, model: Path, env: FuzzEnv) -> None:
        path = model / self.file
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif os.path.lexists(path):
            path.unlink()


@dataclass(frozen=True)
class Truncate:
    """Cut `file` at a byte: `keep` is the fraction of its bytes kept (an interrupted copy)."""

    file: str
    keep: float

    def apply(self, model: Path, env: FuzzEnv) -> None:
        path = model / self.file
        if path.is_file():
            data = path.read_bytes()
            path.write_bytes(data[: int(len(data) * self.keep)])


@dataclass(frozen=True)
class Rename:
    file: str
    to: str

    def apply(self, model: Path, env: FuzzEnv) -> None:
        if os.path.lexists(model / self.file) and not os.path.lexists(model / self.to):
            os.rename(model / self.file, model / self.to)


@dataclass(frozen=True)
class EditJson:
    """One value of a JSON file set to `value` (a wrong type, out of range; DELETE removes it)."""

    file: str
    path: str
    value: Any

    def apply(self, model: Path, env: FuzzEnv) -> None:
        target = model / self.file
        if not target.is_file():
            return
        try:
            data = json.loads(target.read_bytes())
        except ValueError:  # an earlier mutation broke it: nothing to edit
            return
        target.write_text(json.dumps(_set_path(data, self.path, self.value), indent=2))


TWIN = "__twice__"  # write_twice's stand-in for the second key, replaced in the text


def write_twice(tree: Any, path: str, form: str = "json", other: bool = False) -> str | None:
    """`tree` as JSON or YAML text with the key at dotted `path` (a last step `*` or a key not
    there: the object's first key) written twice, with the same value or `other`'s; None when
    no object is there. Written as text: json.dumps and yaml.safe_dump cannot repeat a key."""
    tree = copy.deepcopy(tree)
    *parents, last = path.split(".")
    node = tree
    for step in parents:
        node = node.get(step) if isinstance(node, dict) else None
    if not isinstance(node, dict) or not node:
        return None
    key = last if last in node else next(iter(node))
    if not isinstance(key, str):
        return None
    items = list(node.items())
    at = [name for name, _ in items].index(key) + 1
    node.clear()
    value = items[at - 1][1]
    node.update([*items[:at], (TWIN, _other(value) if other else value), *items[at:]])
    text = json.dumps(tree, indent=2) if form == "json" else _dump(tree, form)
    return text.replace(json.dumps(TWIN) if form == "json" else TWIN, json.dumps(key), 1)


def _other(value: Any) -> Any:
    """A JSON value unlike `value`."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1 if value - value == 0 else 0  # not NaN or infinite
    if isinstance(value, str):
        return value + "x"
    return [] if value else [0]


@dataclass(frozen=True)
class Twice:
    """A key of a model's JSON file given twice in its object (issue 55): with the same value
    (changes nothing: passes) or another (refused); `path` as write_twice takes it."""

    file: str
    path: str
    same: bool

    def apply(self, model: Path, env: FuzzEnv) -> None:
        target = model / self.file
        try:
            data = json.loads(target.read_bytes())
        except (OSError, ValueError):  # gone, or an earlier mutation broke it
            return
        if text := write_twice(data, self.path, other=not self.same):
            target.write_text(text)


@dataclass(frozen=True)
class Reindex:
    """An edit of model.safetensors.index.json's weight_map (a sharded model's)."""

    edit: str  # move, drop, ghost, escape, escape_real, absolute, number, rename, empty
    tensor: str

    def apply(self, model: Path, env: FuzzEnv) -> None:
        index = model / "model.safetensors.index.json"
        if not index.is_file():
            return
        data = json.loads(index.read_text())
        weights = data.get("weight_map")
        if not isinstance(weights, dict) or self.tensor not in weights:
            return
        shard = weights[self.tensor]
        other = SHARDS[1] if shard == SHARDS[0] else SHARDS[0]
        if self.edit == "move":  # the index says the other shard holds it
            weights[self.tensor] = other
        elif self.edit == "drop":
            del weights[self.tensor]
        elif self.edit == "ghost":  # an entry for a tensor no shard holds
            weights["model.layers.7.mlp.up_proj.weight"] = shard
        elif self.edit == "escape":
            weights[self.tensor] = "../" + shard
        elif self.edit == "escape_real":  # ... and the file is there, outside the folder
            weights[self.tensor] = "../" + shard
            shutil.copy(model / shard, model.parent / shard)
        elif self.edit == "absolute":
            weights[self.tensor] = "/dev/zero"
        elif self.edit == "number":
            weights[self.tensor] = 5
        elif self.edit == "rename":  # a conversion that renamed a key
            weights[self.tensor.replace("model.", "transformer.", 1)] = weights.pop(self.tensor)
        elif self.edit == "empty":
            data["weight_map"] = {}
        index.write_text(json.dumps(data, indent=2))


@dataclass(frozen=True)
class Tamper:
    """One tensor's entry in a safetensors header rewritten (the data left as it is): a dtype
    safetensors lacks, a shape its bytes do not fill, byte ranges that overlap or run backwards."""

    file: str
    tensor: str
    key: str  # dtype, shape, data_offsets
    value: Any

    def apply(self, model: Path, env: FuzzEnv) -> None:
        path = model / self.file
        if not path.is_file() or path.is_symlink():
            return
        try:
            header, data = read_safetensors(path)
        except (ValueError, OSError):
            return
        if not isinstance(header.get(self.tensor), dict):
            return
        header[self.tensor][self.key] = self.value
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        path.write_bytes(len(text).to_bytes(8, "little") + text + data)


@dataclass(frozen=True)
class Swap:
    """`file` replaced by another tiny model's (its config, its weights, its tokenizer)."""

    file: str
    donor: str

    def apply(self, model: Path, env: FuzzEnv) -> None:
        donor = env.donors[self.donor]
        source = donor / self.file
        if self.file.endswith(".safetensors"):
            source = donor / "model.safetensors"
        if source.is_file() and os.path.lexists(model / self.file):
            Remove(self.file).apply(model, env)
            shutil.copy(source, model / self.file)


@dataclass(frozen=True)
class Junk:
    """Bytes written over, before, after or inside `file` (binary junk in a JSON file)."""

    file: str
    data: bytes
    where: str  # replace, prepend, append, insert

    def apply(self, model: Path, env: FuzzEnv) -> None:
        path = model / self.file
        if not path.is_file():
            return
        old = path.read_bytes()
        middle = len(old) // 2
        path.write_bytes(
            {
                "replace": self.data,
                "prepend": self.data + old,
                "append": old + self.data,
                "insert": old[:middle] + self.data + old[middle:],
            }[self.where]
        )


@dataclass(frozen=True)
class Symlink:
    """`file` replaced by a link: to a copy outside the folder, a device, a loop, nowhere."""

    file: str
    to: str  # outside, /dev/zero, /dev/null, /etc/passwd, /, dangling, loop

    def apply(self, model: Path, env: FuzzEnv) -> None:
        path = model / self.file
        target = self.to
        if self.to == "outside":  # the same file, kept outside (as the hub cache's blobs are)
            if not path.is_file():
                return
            target = str(model.parent / f"outside-{self.file}")
            if not os.path.lexists(target):
                shutil.copy(path, target)
        elif self.to == "dangling":
            target = str(model.parent / "nowhere")
        elif self.to == "loop":
            target = self.file
        if os.path.lexists(path):
            Remove(self.file).apply(model, env)
        os.symlink(target, path)


@dataclass(frozen=True)
class Directory:
    """A folder where `file` should be."""

    file: str

    def apply(self, model: Path, env: FuzzEnv) -> None:
        Remove(self.file).apply(model, env)
        (model / self.file).mkdir()


@dataclass(frozen=True)
class Add:
    """A file the folder should not hold, or holds from another tool: `content` is bytes, or
    "pickle" for a torch checkpoint that loads only with weights_only=False."""

    file: str
    content: bytes | str

    def apply(self, model: Path, env: FuzzEnv) -> None:
        content = env.pickle_bytes if self.content == "pickle" else self.content
        if isinstance(content, str):
            content = content.encode()
        (model / self.file).write_bytes(content)


@dataclass(frozen=True)
class Template:
    """A chat template: in chat_template.jinja, or in tokenizer_config.json (the older place)."""

    text: str
    where: str = "jinja"  # jinja, config

    def apply(self, model: Path, env: FuzzEnv) -> None:
        jinja, config = model / "chat_template.jinja", model / "tokenizer_config.json"
        if self.where == "jinja":
            jinja.write_text(self.text)
        else:
            if jinja.is_file():
                jinja.unlink()
            if config.is_file():
                EditJson("tokenizer_config.json", "chat_template", self.text).apply(model, env)


@dataclass(frozen=True)
class AddToken:
    """An added token (issue 55) at the id `offset` past the embedding's rows (-1: its last row),
    in `file`'s added tokens: `text` "new" (a string of its own; on a row the vocabulary holds, a
    clash) or "vocab" (the string the vocabulary gives that id, as Llama lists <s> in both).
    `grow`: rows the embedding and head gain first, as the refusal's fix does. `fits()`: whether
    the tiny Llama (its vocabulary fills every row) then passes."""

    file: str  # tokenizer.json, tokenizer_config.json
    offset: int
    text: str = "new"
    grow: int = 0

    def fits(self) -> bool:
        return self.offset < self.grow if self.offset >= 0 else self.text == "vocab"

    def apply(self, model: Path, env: FuzzEnv) -> None:
        try:
            config = json.loads((model / "config.json").read_bytes())
            vocab = json.loads((model / "tokenizer.json").read_bytes())["model"]["vocab"]
            rows = int(config["vocab_size"])  # the tiny Llama's: its embedding's rows
        except (OSError, ValueError, KeyError, TypeError):  # an earlier mutation broke it
            return
        if self.grow and (model / "model.safetensors").is_file():
            header, data = read_safetensors(model / "model.safetensors")
            tensors = {}
            for name, spec in header.items():
                if name != "__metadata__":
                    dtype, shape, (begin, end) = spec["dtype"], spec["shape"], spec["data_offsets"]
                    tensor = data[begin:end]
                    if name in ("model.embed_tokens.weight", "lm_head.weight"):
                        tensor += bytes(len(tensor) // shape[0] * self.grow)
                        shape = [shape[0] + self.grow, *shape[1:]]
                    tensors[name] = (dtype, shape, tensor)
            write_safetensors(model / "model.safetensors", tensors)
            EditJson("config.json", "vocab_size", rows + self.grow).apply(model, env)
        id = rows + self.offset
        same = [t for t, i in vocab.items() if i == id] if isinstance(vocab, dict) else []
        text = same[0] if self.text == "vocab" and same else f"<|added_{id}|>"
        token = {"id": id, "content": text, "special": True, "normalized": False}
        target = model / self.file
        try:
            data = json.loads(target.read_bytes())
        except (OSError, ValueError):
            return
        if self.file == "tokenizer.json" and isinstance(data.get("added_tokens"), list):
            token.update(single_word=False, lstrip=False, rstrip=False)
            data["added_tokens"].append(token)
        elif self.file == "tokenizer_config.json":
            data.setdefault("added_tokens_decoder", {})[str(id)] = token
        target.write_text(json.dumps(data, indent=2))


# ---------------------------------------------------------------- checkpoint folders


@dataclass(frozen=True)
class CheckpointCase:
    """The tiny Llama (`sharded`: in two shards with an index) with `mutations` applied."""

    mutations: tuple
    sharded: bool = False
    data: str = "python_docs"  # python_docs, or messages (templates render)

    def prepare(self, env: FuzzEnv, root: Path) -> tuple[dict, list[Path]]:
        model = root / "model"
        shutil.copytree(env.sharded if self.sharded else env.single, model, symlinks=True)
        for mutation in self.mutations:
            mutation.apply(model, env)
        dataset = {} if self.data == "python_docs" else {"dataset_name": str(env.messages)}
        return validate_params(model, root, dataset=dataset), [root]


SINGLE_FILES = [
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
]
SHARDED_FILES = [
    "config.json",
    *SHARDS,
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
]
JSON_FILES = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
]
TENSORS = [
    "lm_head.weight",
    "model.embed_tokens.weight",
    "model.norm.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.layers.1.input_layernorm.weight",
]
# Wrong values a JSON field may hold: each type, zero, negative, huge, not-a-number.
WRONG_VALUES = [
    None,
    "64",
    "",
    -1,
    0,
    1.5,
    True,
    10**12,
    [64],
    {},
    {"a": 1},
    float("nan"),
    float("inf"),
    "llama",
]
CONFIG_KEYS = [
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "max_position_embeddings",
    "head_dim",
    "rms_norm_eps",
    "model_type",
    "architectures",
    "dtype",
    "tie_word_embeddings",
    "rope_parameters",
    "rope_parameters.rope_type",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "hidden_act",
    "attention_bias",
    "text_config",
    "",
]
JUNK_BYTES = [b"\x00", b"\xff\xfe\x00junk", b"\x89PNG\r\n\x1a\n", b"{", b"}", b"]]]", b"\xc3("]


def file_mutations(files: list[str]) -> st.SearchStrategy:
    name = st.sampled_from(files)
    return st.one_of(
        st.builds(Remove, name),
        st.builds(Truncate, name, st.floats(0, 0.999)),
        st.builds(
            Rename,
            name,
            st.sampled_from(
                [
                    "pytorch_model.bin",
                    "model.safetensors.part",
                    "Config.json",
                    "config.json.bak",
                    "model-00001-of-00001.safetensors",
                    SHARDS[0],
                    "tokenizer.json",
                ]
            ),
        ),
        st.builds(
            Junk,
            st.sampled_from([f for f in files if f.endswith((".json", ".safetensors"))]),
            st.sampled_from(JUNK_BYTES) | st.binary(min_size=1, max_size=32),
            st.sampled_from(["replace", "prepend", "append", "insert"]),
        ),
        st.builds(
            Symlink,
            name,
            st.sampled_from(
                ["outside", "/dev/zero", "/dev/null", "/etc/passwd", "/", "dangling", "loop"]
            ),
        ),
        st.builds(Directory, name),
        st.builds(Swap, name, st.sampled_from(["qwen3", "gpt_neox"])),
    )


# Values that parse and that AutoConfig reads, but that the model class refuses when it is built
# (or whose rope table lacks them): the file's fault, never a StageDefect (issue 55).
CLASS_REJECTS = [
    ("rope_parameters.rope_type", "nonsense"),
    ("rope_parameters.rope_type", "linear"),  # without its factor
    ("rope_parameters.factor", "two"),  # a default rope ignores it: passes
    ("rope_scaling", {"rope_type": "linear"}),
    ("rope_scaling", {"rope_type": "dynamic"}),
    ("dtype", "int8"),
    ("dtype", "bool"),
    ("dtype", "complex64"),
    ("dtype", "foo"),
    ("torch_dtype", "int32"),  # beside dtype, which wins: passes
]
config_edits = st.one_of(
    st.builds(
        EditJson,
        st.just("config.json"),
        st.sampled_from(CONFIG_KEYS),
        st.sampled_from([*WRONG_VALUES, DELETE]),
    ),
    st.builds(lambda change: EditJson("config.json", *change), st.sampled_from(CLASS_REJECTS)),
)
stray_files = st.builds(
    Add,
    st.sampled_from(
        [
            "pytorch_model.bin",
            "model.gguf",
            "adapter_config.json",
            "preprocessor_config.json",
            "special_tokens_map.json",
            "added_tokens.json",
            "tokenizer.model",
            "model.safetensors.index.json",
            "quantize_config.json",
            "configuration_llama.py",
        ]
    ),
    st.sampled_from([b"junk", b"{}", b"[]", b'{"a": [1, 2', b"\x00" * 16, "pickle"]),
)
# Header values: (key, value) pairs safetensors or the model would refuse, or misread.
TAMPERED = [
    ("dtype", "F99"),
    ("dtype", "I8"),
    ("dtype", "BF16"),
    ("dtype", "F64"),
    ("dtype", 5),
    ("shape", [1]),
    ("shape", []),
    ("shape", [2048, 257]),
    ("shape", [256, 2048]),
    ("shape", [0]),
    ("data_offsets", [0, 0]),
    ("data_offsets", [0, 16]),
    ("data_offsets", [16, 8]),
]
header_edits = st.builds(
    lambda file, tensor, change: Tamper(file, tensor, *change),
    st.sampled_from(["model.safetensors", *SHARDS]),
    st.sampled_from(TENSORS),
    st.sampled_from(TAMPERED),
)
# Keys a loader reads from an object that keeps one value (tokenizer.json's model.type is an
# untagged enum to `tokenizers`: a repeat there fails to load whatever the value).
TWICE_PLACES = [
    ("config.json", "hidden_size"),
    ("config.json", "rope_parameters.rope_theta"),
    ("config.json", "architectures"),
    ("config.json", "eos_token_id"),
    ("tokenizer.json", "model.vocab.*"),
    ("tokenizer.json", "added_tokens"),
    ("tokenizer.json", "normalizer"),
    ("tokenizer_config.json", "bos_token"),
    ("tokenizer_config.json", "model_max_length"),
    ("generation_config.json", "eos_token_id"),
]
twice_edits = st.builds(
    lambda place, same: Twice(*place, same), st.sampled_from(TWICE_PLACES), st.booleans()
)
index_edits = st.builds(
    Reindex,
    st.sampled_from(
        ["move", "drop", "ghost", "escape", "escape_real", "absolute", "number", "rename", "empty"]
    ),
    st.sampled_from(TENSORS),
)


@st.composite
def checkpoint_cases(draw) -> CheckpointCase:
    sharded = draw(st.booleans())
    files = SHARDED_FILES if sharded else SINGLE_FILES
    one = st.one_of(
        file_mutations(files),
        config_edits,
        stray_files,
        header_edits,
        twice_edits,
        *([index_edits, index_edits] if sharded else []),
    )
    mutations = tuple(draw(st.lists(one, min_size=1, max_size=2)))
    return CheckpointCase(mutations=mutations, sharded=sharded)


# ---------------------------------------------------------------- tokenizers and templates

TEMPLATES = [
    "{% for message in messages %}{{ message['content'] }}",  # an unclosed for
    "{{ messages[0]['content'] ",
    "{% if %}x{% endif %}",
    "{% endfor %}",
    "{{ messages | nosuchfilter }}",
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}",
    "{{ 1 / 0 }}",
    "{% for m in messages %}{{ m.content.nosuch() }}{% endfor %}",
    "{{ messages[9]['content'].upper() }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% include 'other.jinja' %}",
    "{% extends 'base.jinja' %}",
    "{% for i in range(1000000000) %}x{% endfor %}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "",
    "{# renders nothing #}",
    "\x00\xff",
    "{% for message in messages %}{{ message['content'] }}{% endfor %}",  # a valid one
]
TOKENIZER_CONFIG_KEYS = [
    "bos_token",
    "eos_token",
    "pad_token",
    "unk_token",
    "model_max_length",
    "tokenizer_class",
    "chat_template",
    "added_tokens_decoder",
    "extra_special_tokens",
    "backend",
    "",
]
TOKENIZER_JSON_PATHS = [
    "model.type",
    "model.vocab",
    "model.merges",
    "added_tokens",
    "normalizer",
    "pre_tokenizer",
    "post_processor",
    "decoder",
    "version",
    "",
]
TOKENIZER_VALUES = [
    *WRONG_VALUES,
    DELETE,
    "NoSuchTokenizer",
    "LlamaTokenizer",
    {"type": "NoSuch"},
    [{"name": "default", "template": "{{ x"}],
    {"content": 5},
    "<no-such-token>",
]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
# Token ids about the tiny Llama's embedding rows (issue 55): below them, the last, the first past
# them, far past.
TINY_ROWS = 2048
TOKEN_OFFSETS = [-2000, -1, 0, 1, 63, 10**6]


@st.composite
def tokenizer_cases(draw) -> CheckpointCase:
    one = st.one_of(
        st.builds(Template, st.sampled_from(TEMPLATES), st.sampled_from(["jinja", "config"])),
        st.builds(
            EditJson,
            st.just("tokenizer_config.json"),
            st.sampled_from(TOKENIZER_CONFIG_KEYS),
            st.sampled_from(TOKENIZER_VALUES),
        ),
        st.builds(
            EditJson,
            st.just("tokenizer.json"),
            st.sampled_from(TOKENIZER_JSON_PATHS),
            st.sampled_from(TOKENIZER_VALUES),
        ),
        st.builds(
            AddToken,
            st.sampled_from(["tokenizer.json", "tokenizer_config.json"]),
            st.sampled_from(TOKEN_OFFSETS),
            st.sampled_from(["new", "vocab"]),
            st.sampled_from([0, 0, 64]),
        ),
        st.builds(
            EditJson,
            st.sampled_from(["config.json", "generation_config.json"]),
            st.sampled_from(["bos_token_id", "eos_token_id", "pad_token_id"]),
            st.sampled_from(TOKEN_OFFSETS).map(lambda offset: TINY_ROWS + offset),
        ),
        st.builds(Remove, st.sampled_from(TOKENIZER_FILES)),
        twice_edits,
        st.builds(Truncate, st.sampled_from(TOKENIZER_FILES), st.floats(0, 0.999)),
        st.builds(
            Junk,
            st.sampled_from(TOKENIZER_FILES),
            st.sampled_from(JUNK_BYTES),
            st.sampled_from(["replace", "prepend", "insert"]),
        ),
    )
    mutations = tuple(draw(st.lists(one, min_size=1, max_size=2)))
    data = draw(st.sampled_from(["messages", "messages", "python_docs"]))
    return CheckpointCase(mutations=mutations, data=data)


# ---------------------------------------------------------------- recipes


@dataclass(frozen=True)
class RecipeCase:
    """The `recipe` parameter group as given (a preset with recipe_args, or recipe text)."""

    recipe: dict
    file: str | None = None  # recipe text written to this file in the case's folder, named instead
    raw: str | None = None  # the recipe is RAW_RECIPES[raw]
    target: dict | None = None  # a quality target or bits budget the recipe must be able to meet
    calibration: dict | None = None  # memory caps and batch the plan must honour or refuse
    twice: str | None = None  # the text writes a key twice: "same" value or "other" (refused)
    # A sparsity stage (SparseGPT, Wanda): "refused", for any reason; "named", refused naming it
    # (its only change from a preset, placed as a method is: nothing refused sooner)
    sparse: str | None = None

    def prepare(self, env: FuzzEnv, root: Path) -> tuple[dict, list[Path]]:
        recipe = dict(self.recipe)
        if self.raw is not None:
            recipe["recipe"] = RAW_RECIPES[self.raw]()
        if self.file is not None:
            path = root / self.file
            path.write_text(recipe.pop("text"))
            recipe["recipe"] = str(path)
        extra = {"target": self.target, "calibration": self.calibration}
        extra = {name: group for name, group in extra.items() if group is not None}
        return validate_params(env.shared, root, recipe=recipe, **extra), [root, env.shared]


# A target beside the recipe: budgets below or above what a family reaches, methods that do
# not exist, ratios that are gains, and values of the wrong type.
TARGET_VALUES = {
    "avg_bits": [0, 3.9, 4.125, 4.5, 6, 16, 16.5, -1, float("nan"), float("inf"), "4.5", "x", True],
    "max_perplexity_ratio": [0, 0.5, 1.02, 10.5, float("nan")],
    "method": ["auto", "mixed_precision", "leave_unquantized", "knapsack", ""],
}
targets = st.none() | st.fixed_dictionaries(
    {}, optional={name: st.sampled_from(values) for name, values in TARGET_VALUES.items()}
)
# Memory caps beside the recipe: none, below any need, huge, a GPU cap on this GPU-less worker,
# and values of the wrong type or sign.
CALIBRATION_VALUES = {
    "max_gpu_memory_gb": [0, 1e-6, 0.5, 80, 1e9, -1, float("nan"), float("inf"), "8", "x"],
    "max_cpu_memory_gb": [0, 1e-6, 0.05, 64, -2, float("inf")],
    "batch_size": [0, 1, 16, 4096, -1],
}
calibrations = st.none() | st.fixed_dictionaries(
    {}, optional={name: st.sampled_from(values) for name, values in CALIBRATION_VALUES.items()}
)


def _preset_tree(name: str) -> dict:
    """A preset's recipe as data, its placeholders filled with their defaults."""
    from compressflow.recipes.placeholders import substitute

    preset = PRESETS[name]
    return substitute(yaml.safe_load(preset.template), preset.defaults())


OTHER_MODIFIERS = [
    {"SmoothQuantModifier": {"smoothing_strength": 0.8}},
    {"GPTQModifier": {"targets": "Linear", "scheme": "W8A8", "ignore": ["lm_head"]}},
    {"QuantizationModifier": {"targets": "Linear", "scheme": "FP8_DYNAMIC", "ignore": ["lm_head"]}},
    {"QuantizationModifier": {"targets": ["re:.*q_proj"], "scheme": "W4A16"}},
    {"AWQModifier": {}},
    {"SparseGPTModifier": {"sparsity": 0.5, "targets": ["Linear"], "ignore": ["lm_head"]}},
    {"GPTQModifer": {"targets": "Linear", "scheme": "W4A16"}},
    {"QuIPModifier": {"targets": "Linear"}},
    {"SpinQuantModifier": {"rotations": ["R1", "R2"]}},
    {"ConstantPruningModifier": {"targets": "__ALL__"}},
    {"LogarithmicEqualizationModifier": {}},
    {"": {}},
    {"GPTQModifier": None},
    {"GPTQModifier": "W4A16"},
]


def _order_pairs() -> list[dict]:
    """Two modifiers of kinds with an order (quantizing, then pruning or rotating), in both
    orders, on the same layers and on disjoint ones (compressflow/recipes/kinds.py): refused
    only in the forbidden order on common layers."""
    attention, mlp = r"re:.*self_attn\.(q|k|v|o)_proj$", r"re:.*mlp\.(gate|up|down)_proj$"
    quantize = {"QuantizationModifier": {"scheme": "W8A8"}}
    others = [{"SparseGPTModifier": {"sparsity": 0.5}}, {"QuIPModifier": {"rotations": ["v"]}}]
    pairs = []
    for other in others:
        for first, second in [
            (attention, attention),
            (attention, mlp),
            (attention, "re:.*q_proj$"),
        ]:
            one = {n: {**k, "targets": first} for n, k in quantize.items()}
            two = {n: {**k, "targets": second} for n, k in other.items()}
            pairs += [{**one, **two}, {**two, **one}]
    return pairs


OTHER_MODIFIERS += _order_pairs()
# Issue 57's methods, as llm-compressor's examples write them: rotations, 2:4 and unstructured
# sparsity (refused at render: vLLM 0.32 serves no sparse checkpoint; RecipeCase.sparse) and
# expert pruning (the tiny Llama is dense: refused), each alone (`alone`) and before or beside
# every preset's modifiers.
METHODS = [
    {"QuIPModifier": {"transform_type": "hadamard", "transform_block_size": 128}},
    {"SpinQuantModifier": {"rotations": ["R1", "R2"], "transform_type": "hadamard"}},
    {"SparseGPTModifier": {"sparsity": 0.5, "mask_structure": "2:4", "targets": ["Linear"]}},
    {"WandaPruningModifier": {"sparsity": 0.5, "targets": ["Linear"], "ignore": ["lm_head"]}},
    {"REAPPruningModifier": {"sparsity": 0.25}},
]
OTHER_MODIFIERS += METHODS
# recipe.prune_experts: valid fractions (refused on the dense tiny Llama), and out of range.
PRUNE_EXPERTS = [0.25, 0.5, 0.01, -0.25, 1, 1.5, float("nan"), "0.25", "x", True]
MODIFIER_FIELDS = [
    "targets",
    "scheme",
    "ignore",
    "dampening_frac",
    "block_size",
    "kv_cache_scheme",
    "config_groups",
    "smoothing_strength",
    "mappings",
    "observer",
    "actorder",
    "offload_hessians",
    "n_grid",
    "nosuchfield",
]
RECIPE_VALUES = [
    *WRONG_VALUES,
    "$undefined",
    "W4A15",
    "Embedding",
    ["re:[unclosed"],
    "re:(lm_head",  # patterns re cannot compile, as targets, ignore or mappings
    [[["re:.*q_proj$"], "re:*norm$"]],
    ["lm_head", "model.norm"],
    {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": -1}}},
    {"group_0": {"targets": ["Linear"], "weights": {"num_bits": "four"}}},
    {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "strategy": "block"}}},
    {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "strategy": "group"}}},
    {"num_bits": 8, "type": "float"},
    [[["re:.*q_proj"], "re:.*input_layernorm"]],
    "group",
    10**30,
    -(10**30),
    "1e400",
]


@dataclass(frozen=True)
class _Edit:
    """One change to a recipe tree, for the recipe strategy."""

    kind: str
    name: str
    value: Any


def _apply_recipe_edit(tree: Any, edit: _Edit) -> Any:
    from compressflow.recipes.tree import iter_modifiers

    modifiers = (
        [(kwargs) for _, _, kwargs in iter_modifiers(tree)] if isinstance(tree, dict) else []
    )
    stage = tree.get("quant_stage", {}).get("quant_modifiers") if isinstance(tree, dict) else None
    if edit.kind == "field" and modifiers and isinstance(modifiers[0], dict):
        if edit.value == DELETE:
            modifiers[0].pop(edit.name, None)
        else:
            modifiers[0][edit.name] = copy.deepcopy(edit.value)
    value = copy.deepcopy(edit.value)  # never the strategy's own constants: edits mutate
    if edit.kind == "add" and isinstance(stage, dict):
        stage.update(value)  # a second modifier (or the same one, replaced)
    elif edit.kind == "first" and isinstance(stage, dict):
        tree["quant_stage"]["quant_modifiers"] = {**value, **stage}
    elif edit.kind == "stage" and isinstance(tree, dict):  # another stage, before the first
        tree = {edit.name: {"modifiers": value}, **tree}
    elif edit.kind == "list" and isinstance(stage, dict):  # the list form
        tree = [{name: kwargs} for name, kwargs in stage.items()] + [value]
    elif edit.kind == "alone":  # the method as the whole recipe
        tree = {"method_stage": {"method_modifiers": value}}
    elif edit.kind == "nest":
        for _ in range(int(edit.value)):
            tree = {edit.name: tree}
    return tree


def _dump(tree: Any, form: str) -> str:
    if form == "json":
        return json.dumps(tree)
    return yaml.safe_dump(tree, sort_keys=False, allow_unicode=True)


def _first_keys(tree: Any, depth: int) -> list[str]:
    """The first key at each level, down `depth` levels of mappings at most."""
    path: list[str] = []
    while len(path) < depth and isinstance(tree, dict) and tree:
        key, tree = next(iter(tree.items()))
        if not isinstance(tree, dict):
            break
        path.append(key)
    return path


# Recipe text as typed, pasted or attacked with, by name (the long ones are built on use).
RAW_RECIPES: dict[str, Callable[[], str]] = {
    "empty": lambda: "",
    "blank": lambda: "   ",
    "tilde": lambda: "~",
    "null": lambda: "null",
    "number": lambda: "42",
    "open bracket": lambda: "[",
    "5000 braces": lambda: "{" * 5000,
    "100 nested lists": lambda: "[" * 100 + "]" * 100,
    "billion laughs": lambda: (
        "a: &a [x, x, x, x, x, x, x, x, x]\n"
        + "".join(
            f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
            for p, c in zip("abcdefgh", "bcdefghi", strict=True)
        )
    ),
    "tab indent": lambda: "quant_stage:\n  quant_modifiers:\n\tGPTQModifier: {}\n",
    "repeated keys": lambda: (
        "quant_stage:\n  quant_modifiers:\n    GPTQModifier: {targets: Linear, scheme: W4A16}\n" * 3
    ),
    "nul byte": lambda: (
        "quant_stage: {quant_modifiers: {GPTQModifier: {targets: Linear, scheme: W4A16}}}\n\x00"
    ),
    "python object": lambda: "!!python/object/apply:os.system ['echo pwned']",
    "python name key": lambda: (
        "quant_stage:\n  quant_modifiers:\n    !!python/name:os.system : {}\n"
    ),
    "braced placeholder": lambda: (
        "quant_stage:\n  quant_modifiers:\n    GPTQModifier: {targets: "
        "Linear, scheme: W4A16, dampening_frac: ${damp}}\n"
    ),
    "zoo stub": lambda: "zoo:llama2-7b/quantization-w4a16",
    "missing file": lambda: "recipe.yaml",
    "device file": lambda: "/dev/zero.yaml",
    "proc file": lambda: "/proc/self/status.yaml",
    "two presets": lambda: "W4A16\nW8A8",
    "lower-case preset": lambda: "w4a16",
    "spaced preset": lambda: " FP8-dynamic ",
    "2 MiB value": lambda: "x: " + "y" * (2 << 20),
    "120,000 keys": lambda: "\n".join(f"k{i}: {i}" for i in range(120_000)),
}


@st.composite
def recipe_cases(draw) -> RecipeCase:
    form = draw(st.sampled_from(["preset", "tree", "tree", "raw", "file", "method"]))
    if form == "preset":
        preset = draw(st.sampled_from([*PRESETS, "w8a8", "W4A61", "", "fp8_dynamic "]))
        names = list(PRESETS[preset].placeholders) if preset in PRESETS else []
        args = draw(
            st.dictionaries(
                st.sampled_from([*names, "damp", "nosuch", "$ignore", ""]),
                st.sampled_from([*RECIPE_VALUES, "fp8", "fp16"]),
                max_size=2,
            )
        )
        recipe = {"recipe": preset, "recipe_args": args}
        if draw(st.booleans()):
            recipe["prune_experts"] = draw(st.sampled_from(PRUNE_EXPERTS))
        return RecipeCase(
            recipe,
            target=draw(targets),
            calibration=draw(calibrations),
        )
    if form == "raw":
        return RecipeCase(
            {},
            raw=draw(st.sampled_from(sorted(RAW_RECIPES))),
            target=draw(targets),
            calibration=draw(calibrations),
        )
    tree = _preset_tree(
        draw(st.sampled_from(["W4A16", "W8A8", "FP8_DYNAMIC", "W4AFP8", "NVFP4A16", "W4A16_QUIP"]))
    )
    edit = st.one_of(
        st.builds(
            _Edit,
            st.just("field"),
            st.sampled_from(MODIFIER_FIELDS),
            st.sampled_from([*RECIPE_VALUES, DELETE]),
        ),
        st.builds(
            _Edit,
            st.sampled_from(["add", "first", "list"]),
            st.just(""),
            st.sampled_from(OTHER_MODIFIERS),
        ),
        st.builds(_Edit, st.just("alone"), st.just(""), st.sampled_from(METHODS)),
        st.builds(
            _Edit,
            st.just("stage"),
            st.sampled_from(["pre_stage", "quant_stage", ""]),
            st.sampled_from(OTHER_MODIFIERS),
        ),
        st.builds(
            _Edit, st.just("nest"), st.sampled_from(["quant_stage", "x"]), st.integers(1, 70)
        ),
    )
    # "method": issue 57's methods placed on a preset, nothing else changed (not in the list
    # form, where a method the preset has already is a second one, refused as that)
    placed = st.builds(
        _Edit,
        st.sampled_from(["alone", "add", "first"]),
        st.just(""),
        st.sampled_from(METHODS),
    )
    edits = draw(st.lists(placed if form == "method" else edit, min_size=1, max_size=3))
    for one in edits:
        tree = _apply_recipe_edit(tree, one)
    form_of_text = draw(st.sampled_from(["yaml", "json"]))
    text = _dump(tree, form_of_text)
    if form == "method":
        case = RecipeCase({"recipe": text})
        return dataclasses.replace(case, sparse="named") if _holds_sparsity(tree) else case
    twice = draw(st.sampled_from([None, None, "other", None, None, "same", None, None]))
    if twice:  # a key written twice, 0 to 3 levels down: a stage, a group, a modifier, a field
        path = _first_keys(tree, draw(st.integers(0, 3)))
        doubled = write_twice(tree, ".".join([*path, "*"]), form_of_text, twice == "other")
        text, twice = (doubled, twice) if doubled else (text, None)
    args = draw(
        st.dictionaries(
            st.sampled_from(["undefined", "damp"]), st.sampled_from([0.1, "x"]), max_size=1
        )
    )
    recipe = {"text": text} if form == "file" else {"recipe": text}
    if args:
        recipe["recipe_args"] = args
    case = RecipeCase(
        recipe,
        file="recipe.yaml" if form == "file" else None,
        target=draw(targets),
        calibration=draw(calibrations),
        twice=twice,
    )
    if not _holds_sparsity(tree):
        return case
    placed = all(e.kind in ("alone", "add", "first") and e.value in METHODS for e in edits)
    only = placed and not (twice or args or case.target or case.calibration)
    return dataclasses.replace(case, sparse="named" if only else "refused")


def _holds_sparsity(tree: Any) -> bool:
    """Whether a recipe tree has a modifier render refuses as a sparsity stage."""
    from compressflow.recipes.kinds import sparsity_refusal
    from compressflow.recipes.tree import iter_modifiers

    try:
        if isinstance(tree, list):
            found = [(n, k) for item in tree if isinstance(item, dict) for n, k in item.items()]
        else:
            found = [(name, kwargs) for _, name, kwargs in iter_modifiers(tree)]
    except (AttributeError, TypeError):  # a tree no stage walk reads: refused, but not for this
        return False
    return any(sparsity_refusal(name, kwargs) for name, kwargs in found)


# ---------------------------------------------------------------- data files


@dataclass(frozen=True)
class DataCase:
    """A local data file: its format, encoding, what its rows hold, how many; and how many
    samples are asked of it."""

    suffix: str  # .txt .jsonl .json .csv .parquet
    shape: str  # a key of ROW_SHAPES
    rows: int
    encoding: str = "utf-8"  # utf-8, utf-8-sig, latin-1, utf-16, broken
    samples: int = 8
    huge_row: bool = False
    text_column: str = ""

    def prepare(self, env: FuzzEnv, root: Path) -> tuple[dict, list[Path]]:
        path = root / f"data{self.suffix}"
        write_data(path, self)
        dataset = {"dataset_name": str(path), "text_samples": self.samples}
        if self.text_column:
            dataset["text_column"] = self.text_column
        return validate_params(env.shared, root, dataset=dataset), [root, env.shared]


def _text(i: int) -> str:
    return f"Café {i}: the quick brown fox jumps over the lazy dog. Ünïcode row {i}."


# What a row holds: the valid forms and the wrong ones.
ROW_SHAPES: dict[str, Callable[[int], Any]] = {
    "text": lambda i: {"text": _text(i)},
    "messages": lambda i: {"messages": [{"role": "user", "content": _text(i)}]},
    "sharegpt": lambda i: {"conversations": [{"from": "human", "value": _text(i)}]},
    "number_text": lambda i: {"text": i},
    "list_text": lambda i: {"text": [_text(i), _text(i + 1)]},
    "object_text": lambda i: {"text": {"body": _text(i)}},
    "null_text": lambda i: {"text": None},
    "empty_text": lambda i: {"text": ""},
    "other_column": lambda i: {"content": _text(i)},
    "list_row": lambda i: [_text(i), i],
    "number_row": lambda i: i,
    "string_row": lambda i: _text(i),
    "mixed": lambda i: [{"text": _text(i)}, {"text": i}, [i], None][i % 4],
    "messages_no_content": lambda i: {"messages": [{"role": "user"}]},
    "messages_strings": lambda i: {"messages": [_text(i), "x"]},
    "messages_empty": lambda i: {"messages": []},
    "messages_bad_role": lambda i: {"messages": [{"role": i, "content": None}]},
    "messages_string": lambda i: {"messages": _text(i)},
    "nested": lambda i: {"text": _text(i), "meta": {"a": [{"b": [i]}]}},
}


def _rows(case: DataCase) -> list[Any]:
    rows = [ROW_SHAPES[case.shape](i) for i in range(case.rows)]
    if case.huge_row and rows:
        big = "lorem ipsum " * 200_000  # 2.4 MB in one row
        rows[0] = {"text": big} if isinstance(rows[0], dict) else big
    return rows


def _encode(text: str, encoding: str) -> bytes:
    if encoding == "broken":  # UTF-8 with invalid bytes inside it
        data = text.encode("utf-8")
        return data[: len(data) // 2] + b"\xff\xfe\xc3(" + data[len(data) // 2 :]
    return text.encode(encoding, errors="replace")


def write_data(path: Path, case: DataCase) -> None:
    rows = _rows(case)
    if case.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pa.Table.from_pylist([r if isinstance(r, dict) else {"value": r} for r in rows])
        except (pa.ArrowException, TypeError, ValueError):
            table = pa.table({"text": [json.dumps(r) for r in rows]})
        pq.write_table(table, path)
        return
    if case.suffix == ".txt":
        text = "\n\n".join(
            r["text"] if isinstance(r, dict) and isinstance(r.get("text"), str) else json.dumps(r)
            for r in rows
        )
    elif case.suffix == ".jsonl":
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    elif case.suffix == ".json":
        text = json.dumps(rows, ensure_ascii=False)
    else:  # .csv
        import csv

        out = io.StringIO()
        keys = sorted({k for r in rows if isinstance(r, dict) for k in r}) or ["value"]
        writer = csv.writer(out)
        writer.writerow(keys)
        for r in rows:
            writer.writerow([r.get(k) if isinstance(r, dict) else r for k in keys])
        text = out.getvalue()
    path.write_bytes(_encode(text, case.encoding))


data_cases = st.builds(
    DataCase,
    suffix=st.sampled_from([".txt", ".jsonl", ".json", ".csv", ".parquet"]),
    shape=st.sampled_from(sorted(ROW_SHAPES)),
    rows=st.sampled_from([0, 1, 3, 12, 40]),
    encoding=st.sampled_from(["utf-8", "utf-8", "utf-8-sig", "latin-1", "utf-16", "broken"]),
    samples=st.sampled_from([1, 8, 30]),
    huge_row=st.booleans(),
    text_column=st.sampled_from(["", "", "text", "messages", "nosuch", "meta"]),
)


# ---------------------------------------------------------------- output locations


@dataclass(frozen=True)
class OutputCase:
    """Where the output goes: `where` names the place (OUTPUT_PLACES), `overwrite` as given."""

    where: str
    overwrite: bool = False

    def prepare(self, env: FuzzEnv, root: Path) -> tuple[dict, list[Path]]:
        model = env.shared
        if self.where.startswith("nest:"):  # a source of its own, placed as the case says
            inside = self.where == "nest:source in output"
            model = root / "outer" / "model" if inside else root / "model"
            model.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(env.single, model)
        output = {"save_directory": OUTPUT_PLACES[self.where](root), "overwrite": self.overwrite}
        watched = [root, env.shared]
        if self.where == "empty":  # the default output folder
            from compressflow.settings import settings

            watched.append(settings().output_dir)
        groups = _read_inputs(root, self.where) if self.where.startswith("input:") else {}
        return validate_params(model, root, output=output, **groups), watched

    def held_to(self, outcome: Outcome) -> None:
        """An output placed against an input the run reads: refused on, in or around it,
        passing beside it (INPUT_PLACES says which)."""
        if self.where in INPUT_PLACES:
            words = INPUT_PLACES[self.where]
            assert outcome.refused == bool(words), f"{self!r}: {outcome.error!r}"
            assert words in str(outcome.error or ""), f"{self!r}: {outcome.error!r}"

    def outside(self) -> list[Path]:
        """Places outside the case's folder it names, which must not be created."""
        if self.where.startswith("/") and self.where != "/":
            return [Path(self.where)]
        return []


def _made(root: Path, kind: str) -> str:
    """A place in `root` prepared as `kind`; returns the path to name as save_directory."""
    if kind == "file":
        (root / "taken").write_text("a file")
        return str(root / "taken")
    if kind == "under a file":
        (root / "taken").write_text("a file")
        return str(root / "taken" / "out")
    if kind == "read-only folder":
        (root / "ro").mkdir()
        os.chmod(root / "ro", 0o555)
        return str(root / "ro" / "out")
    if kind == "read-only output":
        (root / "ro").mkdir()
        os.chmod(root / "ro", 0o555)
        return str(root / "ro")
    if kind == "fifo":
        os.mkfifo(root / "pipe")
        return str(root / "pipe")
    if kind == "dangling link":
        os.symlink(root / "nowhere", root / "link")
        return str(root / "link")
    if kind == "link to /proc":
        os.symlink("/proc", root / "link")
        return str(root / "link" / "out")
    if kind == "junk folder":
        (root / "out").mkdir()
        (root / "out" / "notes.txt").write_text("mine")
        return str(root / "out")
    if kind == "empty folder":
        (root / "out").mkdir()
        return str(root / "out")
    if kind == "fake manifest":
        (root / "out").mkdir()
        (root / "out" / "manifest.json").write_text('{"result": 5}')
        return str(root / "out")
    if kind == "manifest dir":
        (root / "out" / "manifest.json").mkdir(parents=True)
        return str(root / "out")
    raise ValueError(kind)


# Outputs against each input the run reads (`_read_inputs` lays them out in the case's folder):
# the words of its refusal where the output is, lies inside or contains it, "" (passes) beside it
# or merely named alike. An output inside the offload folder passes: the run writes there only a
# temporary folder of its own, and removes it.
INPUT_PLACES: dict[str, str] = {
    "input:output in the data folder": "lies inside the calibration data (dataset.dataset_name)",
    "input:output is the data folder": "is the calibration data",
    "input:output holds the data folder": "contains the calibration data",
    "input:output is the data file": "is the calibration data",
    "input:output holds the data file": "contains the calibration data",
    "input:output holds a link to the data": "contains the calibration data",
    "input:output is the recipe file": "is the recipe file (recipe.recipe)",
    "input:output holds the recipe file": "contains the recipe file",
    "input:output is the held-out file": "is the held-out text (target.held_out.dataset_name)",
    "input:output holds the held-out file": "contains the held-out text",
    "input:output is the offload folder": "calibration.offload_folder",
    "input:output holds the offload folder": "calibration.offload_folder",
    "input:output beside the data folder": "",
    "input:output named as the data and more": "",
    "input:output beside the recipe file": "",
    "input:output in the offload folder": "",
}
_INPUT_OUTPUTS: dict[str, str] = {
    "in the data folder": "inputs/data/out",
    "is the data folder": "inputs/data",
    "holds the data folder": "inputs",
    "is the data file": "inputs/data/calib.jsonl",
    "holds the data file": "inputs/data",
    "holds a link to the data": "linked",
    "is the recipe file": "recipes/w4.yaml",
    "holds the recipe file": "recipes",
    "is the held-out file": "eval/held.jsonl",
    "holds the held-out file": "eval",
    "is the offload folder": "offload",
    "holds the offload folder": "scratch",
    "beside the data folder": "inputs/data-w4a16",
    "named as the data and more": "inputs/data2",
    "beside the recipe file": "recipes/w4",
    "in the offload folder": "offload/out",
}


OUTPUT_PLACES: dict[str, Callable[[Path], str]] = {
    "/proc/fuzz-out": lambda root: "/proc/fuzz-out",
    "/proc/self/fuzz-out": lambda root: "/proc/self/fuzz-out",
    "/sys/fuzz-out": lambda root: "/sys/fuzz-out",
    "/dev/null": lambda root: "/dev/null",
    "/dev/zero/out": lambda root: "/dev/zero/out",
    "/dev/fuzz-out": lambda root: "/dev/fuzz-out",
    "/": lambda root: "/",
    "empty": lambda root: "",
    "blank": lambda root: "   ",
    "dot": lambda root: ".",
    "dotdot": lambda root: str(root / "a" / ".." / ".."),
    "trailing slash": lambda root: str(root / "out") + "/",
    "newline": lambda root: str(root / "out\nx"),
    "nul byte": lambda root: str(root / "out\x00x"),
    "spaces only": lambda root: "   ",
    "pasted with a space": lambda root: f" {root / 'out'}",
    "name 255": lambda root: str(root / ("n" * 255)),
    "name 256": lambda root: str(root / ("n" * 256)),
    "path 5000": lambda root: str(root / "/".join(["d" * 200] * 25)),
    "file": lambda root: _made(root, "file"),
    "under a file": lambda root: _made(root, "under a file"),
    "read-only folder": lambda root: _made(root, "read-only folder"),
    "read-only output": lambda root: _made(root, "read-only output"),
    "fifo": lambda root: _made(root, "fifo"),
    "dangling link": lambda root: _made(root, "dangling link"),
    "link to /proc": lambda root: _made(root, "link to /proc"),
    "junk folder": lambda root: _made(root, "junk folder"),
    "empty folder": lambda root: _made(root, "empty folder"),
    "fake manifest": lambda root: _made(root, "fake manifest"),
    "manifest dir": lambda root: _made(root, "manifest dir"),
    "nest:output is source": lambda root: str(root / "model"),
    "nest:output in source": lambda root: str(root / "model" / "out"),
    "nest:source in output": lambda root: str(root / "outer"),
    "nest:output via link to source": lambda root: _link(root, root / "model", "link"),
    "nest:output parent links into source": lambda root: (
        _link(root, root / "model", "link") + "/out"
    ),
    **{
        f"input:output {case}": (lambda root, place=place: str(root / place))
        for case, place in _INPUT_OUTPUTS.items()
    },
}


def _read_inputs(root: Path, where: str) -> dict[str, dict]:
    """The inputs an `input:` case's run reads, made in `root`: a data folder of one JSON-lines
    file (dataset_name names the file in the data-file cases, else the folder; in the link case,
    a link inside the output to the data), a recipe file, held-out text (a perplexity target)
    and an offload folder where the case is about them."""
    case = where.removeprefix("input:output ")
    data = root / "inputs" / "data"
    data.mkdir(parents=True)
    (data / "calib.jsonl").write_text('{"text": "def f(x):\\n    return x + 1"}\n' * 16)
    (root / "recipes").mkdir()
    (root / "recipes" / "w4.yaml").write_text(
        "quant_stage:\n  quant_modifiers:\n    GPTQModifier: "
        "{targets: Linear, scheme: W4A16, ignore: [lm_head]}\n"
    )
    named = data / "calib.jsonl" if "data file" in case else data
    if "link" in case:
        (root / "linked").mkdir()
        named = Path(_link(root / "linked", data, "data"))
    groups = {
        "dataset": {"dataset_name": str(named)},
        "recipe": {"recipe": str(root / "recipes" / "w4.yaml")},
    }
    if "held-out" in case:
        (root / "eval").mkdir()
        (root / "eval" / "held.jsonl").write_text('{"text": "x = [1, 2, 3]"}\n' * 16)
        held_out = {"dataset_name": str(root / "eval" / "held.jsonl"), "samples": 4}
        groups["target"] = {"max_perplexity_ratio": 1.5, "held_out": held_out}
    if "offload" in case:
        offload = root / "scratch" / "offload" if "holds" in case else root / "offload"
        groups["calibration"] = {"offload_folder": str(offload)}
    return groups


def _link(root: Path, target: Path, name: str) -> str:
    if not os.path.lexists(root / name):
        os.symlink(target, root / name)
    return str(root / name)


output_cases = st.builds(OutputCase, st.sampled_from(sorted(OUTPUT_PLACES)), st.booleans())


# ---------------------------------------------------------------- worker settings


@dataclass(frozen=True)
class SettingsCase:
    """A worker's COMPRESSFLOW_ variable as typed by hand: a setting's name (or a misspelt one:
    `name` as written), `value` one of SETTING_VALUES. Set only while the case runs."""

    name: str
    value: str

    def prepare(self, env: FuzzEnv, root: Path) -> tuple[dict, list[Path]]:
        # No save_directory: the output folder is COMPRESSFLOW_OUTPUT_DIR's to say. Watched: the
        # source only; a setting that passes may write its cache in the case's folder.
        return validate_params(env.shared, root, output={"save_directory": ""}), [env.shared]

    def variables(self, root: Path) -> dict[str, str]:
        # HOME too: "~" names the case's folder, not the home of whoever runs the tests.
        return {"HOME": str(root), self.name: SETTING_VALUES[self.value](root)}


def _setting_names() -> list[str]:
    from compressflow.settings import Settings, variable

    return sorted(variable(name) for name in Settings.model_fields)


def _misspelt(draw, name: str) -> str:
    """`name` as tired hands type it, or as it is."""
    from compressflow.settings import PREFIX

    typo = draw(st.sampled_from(["", "", "", "drop", "cut", "lower", "space"]))
    if typo == "drop":  # a letter of the setting's own part
        at = draw(st.integers(len(PREFIX), len(name) - 1))
        return name[:at] + name[at + 1 :]
    return {"cut": name.rsplit("_", 1)[0], "lower": name.lower(), "space": name + " "}.get(
        typo, name
    )


SETTING_VALUES: dict[str, Callable[[Path], str]] = {
    **{
        repr(text): (lambda root, text=text: text)
        for text in [
            "",
            " ",
            "0",
            "-1",
            "1",
            "3",
            " 900 ",
            "1e309",
            "inf",
            "-inf",
            "nan",
            "15m",
            "1_000",
            "0x10",
            "\uff19\uff10\uff10",
            "true",
            "off",
            "none",
            "0,1",
            "-1,0",
            "GPU-0a1b-2c",
            "0;rm -rf ~",
            "a/b",
            "%",
            "${HOME}",
            "~",
            "~no-such-user/x",  # left as it is: a relative path ("~nobody" is /nonexistent)
            "..",  # not "/": as root, a cache there would be written (it passes, rightly)
            "/proc/self",
            "/dev/null",
            "/sys/x",
            "x" * 5000,
            "\u00e9t\u00e9",
        ]
    },
    **{
        kind: (lambda root, kind=kind: _made(root, kind))
        for kind in ["file", "under a file", "read-only folder", "fifo", "link to /proc"]
    },
    "a new folder": lambda root: str(root / "new" / "deeper"),
}


@st.composite
def settings_cases(draw) -> SettingsCase:
    """Every setting's variable (new settings join by themselves), or one misspelt as tired
    hands do: a letter dropped, a word left off, lower case, a space after."""
    name = _misspelt(draw, draw(st.sampled_from(_setting_names())))
    return SettingsCase(name, draw(st.sampled_from(sorted(SETTING_VALUES))))


def run_settings(env: FuzzEnv, case: SettingsCase) -> Ran:
    """`case` through `validate`: held to the property, and a refusal names the variable (or
    its value: the folder it names) so the one who set it knows what to change; a refused case
    leaves its folder as it was, a passing one may have written there the cache it names."""
    from compressflow.flows.validate import validate

    with case_folder(env) as root, working_directory(root):
        params, watched = case.prepare(env, root)
        variables = case.variables(root)
        before = snapshot(root)
        with mock.patch.dict(os.environ, variables):
            outcome = assert_refused_or_sound(lambda: validate(**params), case, watched)
        if outcome.refused:
            text = str(outcome.error)
            assert case.name.strip().upper() in text.upper(), (
                f"{case!r}: the refusal does not name the variable: {text}"
            )
            assert snapshot(root) == before, f"{case!r}: refused, but wrote in its folder"
        return Ran(case, outcome, params)


# ---------------------------------------------------------------- a published output, changed since


@dataclass(frozen=True)
class PublishedCase:
    """The output these very inputs publish, already at save_directory (a copy of a real run's),
    with `mutations` applied: what a rerun finds after a corrupted copy, a hand edit, a tool
    that wrote into the folder, an edited manifest. `overwrite` as given."""

    mutations: tuple
    overwrite: bool = False

    def prepare(self, env: FuzzEnv, root: Path) -> tuple[dict, list[Path]]:
        out = root / "out"
        shutil.copytree(env.published.published.path, out, symlinks=True)
        for mutation in self.mutations:
            mutation.apply(out, env)
        run = env.published.params
        params = {name: run[name].model_dump() for name in run if name != "tracking"}
        params["output"].update(save_directory=str(out), overwrite=self.overwrite)
        return params, [root, Path(params["model"]["model_id"])]


@dataclass(frozen=True)
class Rehash:
    """The manifest's sha256 of `file` edited: dropped (DELETE), wrong, of the wrong type, or
    an entry for a file the folder never held. Never the file's new hash: a manifest edited to
    match edited weights is a forgery, which no check inside the folder can tell."""

    file: str
    value: Any

    def apply(self, model: Path, env: FuzzEnv) -> None:
        manifest = model / "manifest.json"
        try:
            data = json.loads(manifest.read_bytes())
        except (OSError, ValueError):  # an earlier mutation removed or broke it
            return
        hashes = data.get("file_sha256")
        if not isinstance(hashes, dict):
            return
        if self.value == DELETE:
            hashes.pop(self.file, None)
        else:
            hashes[self.file] = self.value
        manifest.write_text(json.dumps(data, indent=2))


PUBLISHED_FILES = [
    "model.safetensors",
    "config.json",
    "recipe.yaml",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
    "manifest.json",
    "README.md",
]
MANIFEST_KEYS = ["file_sha256", "files", "result.run_key", "verification.passed", "created_at"]
manifest_edits = st.one_of(
    st.builds(
        EditJson,
        st.just("manifest.json"),
        st.sampled_from(MANIFEST_KEYS),
        st.sampled_from([DELETE, None, {}, [], "x", 0, True]),
    ),
    st.builds(
        Rehash,
        st.sampled_from([*PUBLISHED_FILES, "ghost.safetensors", "../escape", "/etc/passwd"]),
        st.sampled_from([DELETE, "0" * 64, "", 5, None]),
    ),
)
# Files a tool or a person leaves in a published folder: each a loader may read.
added_files = st.builds(
    Add,
    st.sampled_from(
        [
            "model-00002-of-00002.safetensors",
            "extra.safetensors",
            "model.safetensors.index.json",
            "pytorch_model.bin",
            "adapter_config.json",
            "notes.txt",
            ".README.md.123.tmp",
        ]
    ),
    st.sampled_from([b"{}", b"junk", "pickle"]),
)


@st.composite
def published_cases(draw) -> PublishedCase:
    one = st.one_of(file_mutations(PUBLISHED_FILES), manifest_edits, added_files)
    return PublishedCase(
        mutations=tuple(draw(st.lists(one, min_size=1, max_size=2))),
        overwrite=draw(st.booleans()),
    )


def run_published(env: FuzzEnv, case: PublishedCase) -> Ran:
    """`case` through `validate`, held to the property; and a folder `validate` says a run would
    reuse holds exactly what was published: every file's bytes, as plain files, and no other."""
    from compressflow.flows.validate import validate

    original = Path(env.published.published.path)
    with case_folder(env) as root, working_directory(root):
        params, watched = case.prepare(env, root)
        outcome = assert_refused_or_sound(lambda: validate(**params), case, watched)
        if not outcome.refused and outcome.result.reuses_output:
            assert_as_published(case, root / "out", original)
        return Ran(case, outcome, params)


def assert_as_published(case: Any, folder: Path, original: Path) -> None:
    """`folder` holds what `original` was published with: the same entries, the same bytes, no
    links (the manifest and card aside: later runs rewrite them, by design)."""
    rewritten = ("manifest.json", "README.md")
    held = {k: v for k, v in snapshot(folder).items() if k not in rewritten}
    made = {k: v for k, v in snapshot(original).items() if k not in rewritten}
    assert held == made, f"{case!r}: reused a folder that is not what was published"


def run_published_flow(env: FuzzEnv, case: PublishedCase) -> Ran:
    """`case` through the whole flow: refused as the property says (nothing in the case's folder
    changed but the output's lock file); or reused, the folder as it was published; or published
    anew, with overwrite: then the folder is exactly what its new manifest says was published."""
    from compressflow.flows.compress import compress
    from compressflow.store.manifest import changed_files, read_manifest

    with case_folder(env) as root, working_directory(root):
        params, _ = case.prepare(env, root)
        out = root / "out"
        before = snapshot(root)
        started = time.perf_counter()
        try:
            result, error = compress(**params), None
        except Exception as exc:  # the property judges every exception
            result, error = None, exc
        outcome = Outcome(error, result, time.perf_counter() - started)
        assert outcome.seconds < COMPRESS_SECONDS, f"{case!r}: took {outcome.seconds:.0f} s"
        lock = f".{out.name}.lock"
        after = {k: v for k, v in snapshot(root).items() if k != lock}
        if error is not None:
            check_refusal(case, error)
            assert after == before, f"{case!r}: refused, but its folder changed ({error})"
        elif result.reused:
            assert_as_published(case, out, Path(env.published.published.path))
        else:
            assert case.overwrite, f"{case!r}: replaced an output without overwrite"
            assert changed_files(out, read_manifest(out)) == [], f"{case!r}: published unsound"

            def outside(entries: dict[str, str]) -> dict[str, str]:
                return {k: v for k, v in entries.items() if k.split(os.sep)[0] != out.name}

            assert outside(after) == outside(before), f"{case!r}: wrote beside its output"
        return Ran(case, outcome, params)


def run_evaluated(env: FuzzEnv, case: PublishedCase) -> Ran:
    """The changed output given to evaluate-model as `compressed`: refused as the property says,
    the folder as it was; or scored, and its results written into its card and manifest only
    when the folder holds what was published (`record_evaluation`), nothing else written."""
    from compressflow.flows.evaluate import evaluate

    original = Path(env.published.published.path)
    with case_folder(env) as root, working_directory(root):
        case.prepare(env, root)
        out = root / "out"
        before = snapshot(root)
        started = time.perf_counter()
        try:
            # Served speed is not what these cases are about: measure_served stays off.
            served = {"measure": False}
            result = evaluate(compressed={"model_id": str(out)}, held_out=HELD_OUT, served=served)
            error = None
        except Exception as exc:  # the property judges every exception
            result, error = None, exc
        outcome = Outcome(error, result, time.perf_counter() - started)
        if error is not None:
            check_refusal(case, error)
        after = snapshot(root)
        written = {name for name in set(before) | set(after) if before.get(name) != after.get(name)}
        recorded = {f"out{os.sep}manifest.json", f"out{os.sep}README.md"}
        assert written <= recorded, f"{case!r}: wrote {sorted(written - recorded)[:4]}"
        if written:
            assert error is None or isinstance(error, QualityThresholdExceeded), case
            assert_as_published(case, out, original)
        return Ran(case, outcome, {})


HELD_OUT = {"samples": 4, "max_seq_len": 32}


# ---------------------------------------------------------------- upload URIs


@dataclass(frozen=True)
class UploadCase:
    """`output.upload_uri` as typed or pasted: `kind` names one of UPLOAD_URIS. A valid file://
    URI passes (its probe writes one object and deletes it); every other is refused naming
    output.upload_uri, before any weights load, and writes nothing. No s3:// URI here reaches
    a server: the malformed ones are refused before any network call (a well-formed one is
    tests/unit/test_upload_params.py's, against moto)."""

    kind: str

    @property
    def valid(self) -> bool:
        return self.kind.startswith("valid:")

    def prepare(self, env: FuzzEnv, root: Path) -> tuple[dict, list[Path]]:
        output = {"upload_uri": UPLOAD_URIS[self.kind](env, root)}
        return validate_params(env.shared, root, output=output), [root, env.shared]


UPLOAD_URIS: dict[str, Callable[[FuzzEnv, Path], str]] = {
    "no scheme": lambda env, root: str(root / "store"),
    "unknown scheme": lambda env, root: "ftpx://bucket/model",
    "scheme not yet": lambda env, root: "gs://bucket/model",
    "short bucket": lambda env, root: "s3://ab/model",
    "upper-case bucket": lambda env, root: "s3://Models/llama",
    "ip bucket": lambda env, root: "s3://10.0.0.1/model",
    "bucket root": lambda env, root: "s3://bucket",
    "bucket root slash": lambda env, root: "s3://bucket/",
    "dotdot": lambda env, root: "s3://bucket/a/../b",
    "dot": lambda env, root: "s3://bucket/./b",
    "empty segment": lambda env, root: "s3://bucket/a//b",
    "credentials": lambda env, root: "s3://AKIAFUZZ:fuzz-secret@bucket/model",
    "query": lambda env, root: "s3://bucket/model?versionId=1",
    "fragment": lambda env, root: "s3://bucket/model#x",
    "host and port": lambda env, root: "s3://localhost:9000/model",
    "file relative": lambda env, root: "file://store/model",
    "file dotdot": lambda env, root: f"file://{root}/a/../store",
    "file credentials": lambda env, root: f"file://me:pw@{root}/store",
    "pasted with a space": lambda env, root: f" file://{root}/store",
    "newline": lambda env, root: f"file://{root}/store\nx",
    "nul byte": lambda env, root: f"file://{root}/store\x00x",
    "long prefix": lambda env, root: "s3://bucket/" + "/".join(["p" * 100] * 10),
    "file in the source": lambda env, root: f"file://{env.shared}/upload",
    "file is the source": lambda env, root: f"file://{env.shared}",
    "file is the output": lambda env, root: f"file://{root}/out",
    "file holds the output": lambda env, root: f"file://{root}",
    "file under a file": lambda env, root: "file://" + _made(root, "file") + "/model",
    "file in /proc": lambda env, root: "file:///proc/fuzz-upload",
    "valid: file": lambda env, root: f"file://{root}/store/model",
    "valid: file, slash": lambda env, root: f"file://{root}/store/model/",
    "valid: file, localhost": lambda env, root: f"file://localhost{root}/store/model",
    "valid: file, escaped": lambda env, root: f"file://{root}/my%20store/model",
}

upload_cases = st.builds(UploadCase, st.sampled_from(sorted(UPLOAD_URIS)))


def run_upload(env: FuzzEnv, case: UploadCase) -> Ran:
    """`case` through `validate`, held to the property; a valid file:// URI passes, every other
    is refused naming output.upload_uri (the secret of a URI with credentials never shown)."""
    ran = run_validate(env, case)
    error = ran.outcome.error
    if case.valid:
        assert error is None, f"{case!r}: a valid upload URI was refused: {error}"
        return ran
    assert error is not None, f"{case!r}: passed validate"
    assert "output.upload_uri" in str(error), f"{case!r}: the refusal names another field: {error}"
    assert "fuzz-secret" not in str(error) and ":pw@" not in str(error), f"{case!r}: {error}"
    return ran


# ---------------------------------------------------------------- served performance parameters


@dataclass(frozen=True)
class ServedCase:
    """evaluate-model's `served` group as typed into the run form: `kind` names one of
    SERVED_VALUES, a field and its value. A valid one passes; every other is refused by the
    group's own validation, each problem read as the CLI reads it (`flows/cli.py`'s `explain`)
    with field, problem and fix, the field naming the one drawn. Nothing is served: the group
    is checked before any stage starts."""

    kind: str

    @property
    def valid(self) -> bool:
        return self.kind.startswith("valid:")


SERVED_VALUES: dict[str, dict[str, Any]] = {
    "no levels": {"concurrency": []},
    "level 0": {"concurrency": [0, 4]},
    "negative level": {"concurrency": [-1]},
    "level over 4096": {"concurrency": [5000]},
    "nine levels": {"concurrency": list(range(1, 10)), "prompts": 64},
    "fractional level": {"concurrency": [1.5]},
    "level as a word": {"concurrency": ["four"]},
    "levels as text": {"concurrency": "1,4"},
    "nested levels": {"concurrency": [[1, 4]]},
    "a level twice": {"concurrency": [4, 1, 4]},
    "fewer prompts than the level": {"concurrency": [1, 64], "prompts": 16},
    "no prompts": {"prompts": 0},
    "input_len 0": {"input_len": 0},
    "input_len 7": {"input_len": 7},
    "input_len huge": {"input_len": 10**6},
    "output_len 0": {"output_len": 0},
    "output_len NaN": {"output_len": float("nan")},
    "no repeats": {"repeats": 0},
    "21 repeats": {"repeats": 21},
    "repeats as a word": {"repeats": "three"},
    "negative timeout": {"timeout_minutes": -1},
    "measure as a word": {"measure": "sometimes"},
    "unknown field": {"concurency": [1, 4]},
    "valid: defaults": {},
    "valid: off": {"measure": False},
    "valid: one level": {"concurrency": [8], "prompts": 8},
    "valid: levels unsorted": {"concurrency": [4, 1]},
    "valid: level as text": {"concurrency": ["2"]},
    "valid: one repeat, no time limit": {"repeats": 1, "timeout_minutes": 0},
}

served_cases = st.builds(ServedCase, st.sampled_from(sorted(SERVED_VALUES)))


def run_served(case: ServedCase) -> None:
    """`case`'s group validated as the flow's parameters are; a valid one passes, every other is
    refused with each problem's field, problem and fix, in well under a second."""
    from pydantic import ValidationError

    from compressflow.flows.cli import explain
    from compressflow.params import ServedArgs

    values = SERVED_VALUES[case.kind]
    started = time.perf_counter()
    try:
        ServedArgs.model_validate(values)
        refusals = []
    except ValidationError as exc:
        refusals = [
            explain({**error, "loc": ("served", *error["loc"])}, {"served": ServedArgs})
            for error in exc.errors()
        ]
    assert time.perf_counter() - started < 1.0, f"{case!r}: slow to validate"
    if case.valid:
        assert not refusals, f"{case!r}: a valid served group was refused: {refusals}"
        return
    assert refusals, f"{case!r}: passed"
    for refusal in refusals:
        check_refusal(case, refusal)
        assert refusal.field.split(".")[:2] in [["served", name] for name in values], (
            f"{case!r}: the refusal names another field: {refusal}"
        )


# ---------------------------------------------------------------- running a case


@dataclass
class Ran:
    """One case run through `validate`."""

    case: Any
    outcome: Outcome
    params: dict = field(default_factory=dict)


def run_validate(env: FuzzEnv, case: Any, seconds: float = VALIDATE_SECONDS) -> Ran:
    """Prepare `case` in a folder of its own, run `validate` on it, hold it to the property."""
    from compressflow.flows.validate import validate

    with case_folder(env) as root, working_directory(root):
        params, watched = case.prepare(env, root)
        absent = case.outside() if isinstance(case, OutputCase) else []
        outcome = assert_refused_or_sound(
            lambda: validate(**params), case, watched, seconds, absent
        )
        assert_no_silent_choice(case, outcome)
        assert_sparsity_refused(case, outcome)
        if isinstance(case, OutputCase):
            case.held_to(outcome)
        return Ran(case, outcome, params)


def assert_no_silent_choice(case: Any, outcome: Outcome) -> None:
    """Issue 55: a key written twice is refused, never one of its values used. In a recipe
    always (YAML allows a key once); in a model's JSON when its values differ, while the same
    value twice, the case's only change, passes."""
    if isinstance(case, RecipeCase) and case.twice:
        assert outcome.refused, f"{case!r}: a recipe that writes a key twice passed"
    twins = [m for m in getattr(case, "mutations", ()) if isinstance(m, Twice)]
    if twins and len(twins) == len(case.mutations):
        if all(m.same for m in twins):
            assert not outcome.refused, f"{case!r}: one value given twice refused: {outcome.error}"
        else:
            assert outcome.refused and "twice" in outcome.error.problem, (
                f"{case!r}: a key given two values {outcome.error or 'passed'}"
            )


def assert_sparsity_refused(case: Any, outcome: Outcome) -> None:
    """Issue 57: a recipe with a sparsity stage is refused (vLLM serves no sparse checkpoint),
    naming the stage where nothing else in the case is refused sooner."""
    if not isinstance(case, RecipeCase) or case.sparse is None:
        return
    assert outcome.refused, f"{case!r}: a recipe with a sparsity stage passed"
    if case.sparse == "named":
        assert "prunes weights to sparsity" in outcome.error.problem, (
            f"{case!r}: refused, but not for its sparsity stage: {outcome.error}"
        )


@contextmanager
def working_directory(folder: Path) -> Iterator[None]:
    """Relative paths a case names resolve inside its own folder."""
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def ready_env(tiny_model: Path, zoo_root: Path, folder: Path) -> FuzzEnv:
    """The inputs the cases mutate copies of, after one valid run, untimed: the stages'
    forkserver imports llm-compressor once, not inside the first case's time limit."""
    from compressflow.flows.validate import validate

    env = FuzzEnv.build(tiny_model, zoo_root, folder)
    with case_folder(env) as root:
        validate(**validate_params(env.shared, root))
    return env


def seeded(examples: int):
    """Hypothesis settings for a fuzz test: the same cases every run (derandomized, no example
    database), no deadline (a case's time is the property's to judge), `examples` of them."""
    return settings(
        derandomize=True,
        database=None,
        deadline=None,
        max_examples=examples,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# ---------------------------------------------------------------- the whole flow (the long run)


def assert_refused_or_published(
    call: Callable[[], Any], case: Any, root: Path, output: Path, sources: list[Path] = ()
) -> Outcome:
    """The property for the whole flow: refused as `assert_refused_or_sound` says (the output's
    lock file, which outlives runs by design, excepted), or published at `output` with nothing
    else in `root` changed: the source byte-for-byte, no staging or offload folder left beside it.
    `sources` outside `root` must not change either."""
    before = snapshot(root)
    untouched = {source: snapshot(source) for source in sources}
    started = time.perf_counter()
    try:
        result, error = call(), None
    except Exception as exc:  # the property judges every exception
        result, error = None, exc
    outcome = Outcome(error, result, time.perf_counter() - started)
    if error is not None:
        check_refusal(case, error)
    assert outcome.seconds < COMPRESS_SECONDS, f"{case!r}: took {outcome.seconds:.0f} s"
    for source, hashed in untouched.items():
        assert snapshot(source) == hashed, f"{case!r}: {source} changed ({error or 'published'})"
    after = snapshot(root)
    changed = sorted(name for name in before if after.get(name) != before[name])
    assert not changed, f"{case!r}: changed {changed[:6]} ({error or 'published'})"
    published = os.path.relpath(output, root)

    def allowed(name: str) -> bool:
        if name == f".{output.name}.lock":
            return True
        return error is None and (name == published or name.startswith(published + os.sep))

    written = sorted(name for name in after if name not in before and not allowed(name))
    assert not written, f"{case!r}: left {written[:6]} ({error or 'published'})"
    return outcome


def held_where_loaded(folder: Path) -> dict[str, bytes]:
    """Each tensor as a loader finds it: through the shard index where there is one (a tensor
    in a shard the index does not name for it is not found), else in model.safetensors."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        single = folder / "model.safetensors"
        return tensors_of_file(single) if single.is_file() else {}
    weight_map = json.loads(index.read_text()).get("weight_map", {})
    found, shards = {}, {}
    for name, shard in weight_map.items():
        path = (folder / str(shard)).resolve()
        if path.parent != folder.resolve() or not path.is_file():
            continue
        shards.setdefault(path, tensors_of_file(path))
        if name in shards[path]:
            found[name] = shards[path][name]
    return found


def tensors_of_file(file: Path) -> dict[str, bytes]:
    try:
        header, data = read_safetensors(file)
    except (ValueError, OSError):
        return {}
    return {
        name: json.dumps([spec["dtype"], spec["shape"]]).encode()
        + data[spec["data_offsets"][0] : spec["data_offsets"][1]]
        for name, spec in header.items()
        if name != "__metadata__" and isinstance(spec, dict)
    }


def run_compress(env: FuzzEnv, case: Any) -> Ran:
    """`case` through the whole flow (its recipe, W4A16 by default, on 8 samples): refused as the
    property says, or published from a source that held every tensor of the original, byte for
    byte, where the loader looks: a source the loader reads incompletely must never publish."""
    from compressflow.flows.compress import compress

    with case_folder(env) as root, working_directory(root):
        params, _ = case.prepare(env, root)
        output = Path(params["output"]["save_directory"])
        source = Path(params["model"]["model_id"])
        outcome = assert_refused_or_published(
            lambda: compress(**params), case, root, output, [env.shared]
        )
        if not outcome.refused:
            want = tensors_of(env.single)
            held = held_where_loaded(source)
            lost = sorted(name for name, data in want.items() if held.get(name) != data)
            assert not lost, (
                f"{case!r}: published from a source the loader reads without {lost[:4]} "
                f"({len(lost)} of {len(want)} tensors missing or changed)"
            )
        return Ran(case, outcome, params)


# ---------------------------------------------------------------- model sources in a store


@dataclass(frozen=True)
class StoreSourceCase:
    """`model.model_id` as a store URI (issue 56): `kind` names one of STORE_SOURCES. A file://
    prefix holding the model (as other tools put it there, or as compressflow uploaded it)
    passes validate, which downloads its configs into the worker's cache, outside the case's
    folder; a malformed URI, an empty prefix, a file, and a published prefix whose objects were
    changed, removed or added to since are refused naming model.model_id, before anything
    downloads, with nothing written. No s3:// URI here reaches a server: the malformed ones are
    refused before any network call (a missing bucket and wrong credentials are
    tests/unit/test_store_source.py's, against moto)."""

    kind: str

    @property
    def valid(self) -> bool:
        return self.kind.startswith("valid:")

    def prepare(self, env: FuzzEnv, root: Path) -> tuple[dict, list[Path]]:
        uri = STORE_SOURCES[self.kind](env, root)
        return validate_params(uri, root), [root, env.shared]


def _published_prefix(env: FuzzEnv, root: Path) -> Path:
    """env.shared sealed with a manifest and committed to a file:// prefix in `root`."""
    from compressflow.store.objects import commit_folder

    sealed = root / "sealed"
    shutil.copytree(env.shared, sealed)
    names = sorted(p.relative_to(sealed).as_posix() for p in sealed.rglob("*") if p.is_file())
    digests = {n: hashlib.sha256((sealed / n).read_bytes()).hexdigest() for n in names}
    manifest = {
        "result": {"run_key": "f" * 64},
        "files": sorted([*names, "manifest.json"]),
        "file_sha256": digests,
    }
    (sealed / "manifest.json").write_text(json.dumps(manifest))
    store = root / "store" / "published"
    commit_folder(sealed, f"file://{store}")
    return store


def _changed(change: Callable[[Path], Any]) -> Callable[[FuzzEnv, Path], str]:
    def uri(env: FuzzEnv, root: Path) -> str:
        store = _published_prefix(env, root)
        change(store)
        return f"file://{store}"

    return uri


def _foreign(env: FuzzEnv, root: Path) -> str:
    shutil.copytree(env.shared, root / "store" / "foreign")
    return f"file://{root}/store/foreign"


STORE_SOURCES: dict[str, Callable[[FuzzEnv, Path], str]] = {
    "unknown scheme": lambda env, root: "ftpx://bucket/model",
    "scheme not yet": lambda env, root: "gs://bucket/model",
    "hub-like with scheme": lambda env, root: "hf://meta-llama/Llama-3.2-1B",
    "upper-case bucket": lambda env, root: "s3://Models/llama",
    "bucket root": lambda env, root: "s3://bucket/",
    "dotdot": lambda env, root: "s3://bucket/a/../b",
    "credentials": lambda env, root: "s3://AKIAFUZZ:fuzz-secret@bucket/model",
    "query": lambda env, root: "s3://bucket/model?versionId=1",
    "host and port": lambda env, root: "s3://localhost:9000/model",
    "file relative": lambda env, root: "file://store/model",
    "file empty prefix": lambda env, root: f"file://{root}/nothing/here",
    "file is a file": lambda env, root: f"file://{_made(root, 'file')}",
    "file under a file": lambda env, root: "file://" + _made(root, "file") + "/model",
    "file newline": lambda env, root: f"file://{root}/store\nx",
    "published, weights changed": _changed(
        lambda store: (store / "model.safetensors").write_bytes(b"\0" * 64)
    ),
    "published, config removed": _changed(lambda store: (store / "config.json").unlink()),
    "published, file added": _changed(lambda store: (store / "extra.py").write_text("x = 1\n")),
    "published, manifest cut": _changed(
        lambda store: (store / "manifest.json").write_text('{"files": [')
    ),
    "valid: foreign": _foreign,
    "valid: published": _changed(lambda store: None),
    "valid: localhost": lambda env, root: _foreign(env, root).replace(
        "file://", "file://localhost"
    ),
}

store_source_cases = st.builds(StoreSourceCase, st.sampled_from(sorted(STORE_SOURCES)))


def run_store_source(env: FuzzEnv, case: StoreSourceCase) -> Ran:
    """`case` through `validate`, held to the property; the valid ones pass, every other is
    refused naming model.model_id (a URI's secret never shown)."""
    ran = run_validate(env, case)
    error = ran.outcome.error
    if case.valid:
        assert error is None, f"{case!r}: a valid store source was refused: {error}"
        return ran
    assert error is not None, f"{case!r}: passed validate"
    assert "model.model_id" in str(error), f"{case!r}: the refusal names another field: {error}"
    assert "fuzz-secret" not in str(error), f"{case!r}: {error}"
    return ran
