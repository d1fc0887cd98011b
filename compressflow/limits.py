"""Bounded parsing of what users hand the flow: YAML and JSON text, and parameter values.

PyYAML keeps an alias as a shared reference, so a 2 kB recipe of nested aliases ("billion
laughs") loads at once and then expands to billions of values in whatever walks, copies or dumps
it; ten thousand nested `[` make its composer recurse past Python's limit. So text is capped
before it is parsed, and the composed node graph is counted *as expanded* (an alias counts its
whole target again) and its depth is capped while it is composed, before anything walks it.

PyYAML and `json` also keep the last of a key written twice in one mapping, silently dropping the
other value: a recipe calibrated with one of two schemes, a model served with one of two
settings. YAML forbids it; here it is refused, naming the key and both places (JSON: both values,
and only when they differ, since a repeated identical value changes nothing).
"""

from __future__ import annotations

import functools
import json
import re
import stat
import types
from pathlib import Path
from typing import Any

import yaml

from compressflow.errors import CompressflowError, InputError

MAX_TEXT_BYTES = 1 << 20  # a recipe or parameter file: the largest real recipe is a few kB
MAX_JSON_BYTES = 16 << 20  # a model's config.json or shard index
MAX_NODES = 100_000  # values once aliases are expanded
MAX_DEPTH = 64  # nesting; recipes nest about 7 deep

_SMALLER = "make {where} smaller"
_NO_ALIASES = "write {where} out in full, without nested aliases (&anchor / *alias), and smaller"


class _LimitHit(Exception):
    """Raised inside the loader with (problem, fix); `load_yaml` turns it into the caller's error."""


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that sizes each node as it is composed: 1 + its children's sizes, where an
    alias's target was already sized, so counting stays linear in the text."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._sizes: dict[yaml.Node, int] = {}
        self._depth = 0
        self._path: list[str] = []  # where the node being composed lies: keys and [indexes]

    def compose_node(self, parent: Any, index: Any) -> yaml.Node:
        if self.check_event(yaml.AliasEvent):
            target = self.anchors.get(self.peek_event().anchor)
            if target is not None and target not in self._sizes:
                raise _LimitHit(
                    "holds an alias inside the value it refers to, so it never ends",
                    "remove that alias (*name inside &name's own value)",
                )
            return super().compose_node(parent, index)
        self._depth += 1
        # compose_mapping_node passes a value's key node as `index`, compose_sequence_node its
        # position, a key None.
        self._path.append(
            index.value
            if isinstance(index, yaml.ScalarNode)
            else f"[{index}]"
            if isinstance(index, int)
            else "?"
            if parent is not None
            else ""
        )
        try:
            if self._depth > MAX_DEPTH:
                raise _LimitHit(
                    f"nests deeper than the limit of {MAX_DEPTH} levels", "write it flatter"
                )
            node = super().compose_node(parent, index)
            if isinstance(node, yaml.MappingNode):
                self._refuse_twice(node)
        finally:
            self._depth -= 1
            self._path.pop()
        children = (
            [n for pair in node.value for n in pair]
            if isinstance(node, yaml.MappingNode)
            else node.value
            if isinstance(node, yaml.SequenceNode)
            else []
        )
        size = self._sizes[node] = 1 + sum(self._sizes[child] for child in children)
        if size > MAX_NODES:
            raise _LimitHit(
                f"expands to more than the limit of {MAX_NODES:,} values once its aliases are "
                "followed",
                _NO_ALIASES,
            )
        return node

    def _refuse_twice(self, node: yaml.MappingNode) -> None:
        """Refuse a key written twice in `node`, as written: keys a merge (`<<: *base`) brings
        in may be overridden, which is what merging is for. Keys are compared as the Python
        values the mapping would hold (`1`, `1.0` and `true` are one key there), so checking
        stays linear: one dict per mapping."""
        seen: dict[Any, tuple[yaml.Node, yaml.Node]] = {}
        for pair in node.value:
            key = pair[0]
            if not isinstance(key, yaml.ScalarNode) or key.tag == _MERGE:
                continue  # a list or map as a key is unhashable: construction refuses it
            value = self._key_value(key)
            if value in seen:
                raise _LimitHit(
                    f"sets `{_dotted([*self._path, key.value])}` twice: "
                    f"{_place(*seen[value])} and {_place(*pair)}; YAML allows a key once "
                    "in a mapping, and the second would silently replace the first",
                    "keep one of them: delete the other, or rename it if it meant another key",
                )
            seen[value] = pair

    def _key_value(self, key: yaml.ScalarNode) -> Any:
        construct = self.yaml_constructors.get(key.tag)
        try:
            value = construct(self, key) if construct else key.value
            hash(value)
        except Exception:  # e.g. `!!int x`: construction refuses it later, in YAML's words
            return (key.tag, key.value)
        return (key.tag, key.value) if isinstance(value, types.GeneratorType) else value


_MERGE = "tag:yaml.org,2002:merge"


def _dotted(steps: list[str]) -> str:
    return "".join(
        step if step.startswith("[") else f".{step}" for step in steps if step
    ).removeprefix(".")


def _place(key: yaml.Node, value: yaml.Node) -> str:
    """`line 4, column 5 ('W4A16')`: where `key` is written, with its value when short."""
    shown = ""
    if isinstance(value, yaml.ScalarNode):
        text = value.value if len(value.value) <= 40 else value.value[:37] + "..."
        shown = f" ({text!r})"
    return f"line {key.start_mark.line + 1}, column {key.start_mark.column + 1}{shown}"


def _too_big(size: int, limit: int) -> str:
    return f"is {size:,} bytes, over the limit of {limit:,} bytes"


def load_yaml(
    text: str, where: str, field: str, error: type[CompressflowError] = InputError
) -> Any:
    """`yaml.safe_load(text)` within the limits above; `error(field, ...)` names the one hit.

    Syntax errors still raise yaml.YAMLError, for the caller to word.
    """
    # A str holds at most 4 bytes per character: encode only text that might fit.
    size = len(text) if len(text) > MAX_TEXT_BYTES else len(text.encode("utf-8"))
    if size > MAX_TEXT_BYTES:
        raise error(
            field, f"{where} {_too_big(size, MAX_TEXT_BYTES)}", _SMALLER.format(where=where)
        )
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    except _LimitHit as exc:
        problem, fix = exc.args
        raise error(field, f"{where} {problem}", fix.format(where=where)) from None
    except RecursionError:  # a safety net: the depth cap stops nesting long before this
        raise error(field, f"{where} nests too deeply to parse", "write it flatter") from None
    finally:
        loader.dispose()


def not_regular(file: Path) -> str | None:
    """What `file` is when it is not a regular file (symbolic links followed), else None.

    Checked before anything opens a user's file: a FIFO blocks its reader forever, a device
    (/dev/zero) never ends, and a folder fails as an OSError a fetch would retry.
    """
    try:
        mode = file.stat().st_mode
    except OSError as exc:  # a dangling or looping symbolic link
        return f"unreadable ({exc.strerror})"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _refuse_special(path: Path, field: str, error: type[CompressflowError]) -> None:
    if kind := not_regular(path):
        raise error(field, f"{path} is {kind}, not a regular file", "name a regular file")


def read_text(
    path: Path, where: str, field: str, error: type[CompressflowError] = InputError
) -> str:
    """A user's text file, refused by its size before any of it is read."""
    _refuse_special(path, field, error)
    size = path.stat().st_size
    if size > MAX_TEXT_BYTES:
        raise error(
            field, f"{where} {_too_big(size, MAX_TEXT_BYTES)}", _SMALLER.format(where=where)
        )
    return path.read_text(encoding="utf-8")


def read_json(path: Path, field: str, error: type[CompressflowError] = InputError) -> Any:
    """A JSON file from a user's model (config.json, a shard index), capped before it is read."""
    _refuse_special(path, field, error)
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise error(
            field,
            f"{path} {_too_big(size, MAX_JSON_BYTES)} for a JSON file compressflow reads",
            f"check {path.name}: a real one is a few MB at most; replace it with the original",
        )
    twice: list[tuple[dict, str, Any, Any]] = []
    try:
        data = json.loads(path.read_bytes(), object_pairs_hook=functools.partial(_pairs, twice))
    except RecursionError:
        raise error(
            field,
            f"{path} nests too deeply to parse",
            f"check {path.name}: replace it with the original",
        ) from None
    if twice:
        held, key, first, second = twice[0]
        raise error(
            field,
            f"{path} gives `{_json_path(data, held, key)}` twice, with two different values: "
            f"{_shown(first)}, then {_shown(second)}; a loader silently keeps one of them",
            f"keep in {path.name} the one the model was trained with, or replace {path.name} "
            "with the model's original",
        )
    return data


def _pairs(twice: list, pairs: list[tuple[str, Any]]) -> dict:
    """One JSON object, as `json` builds it (the last value of a key kept); a key given twice
    with two different values is noted in `twice`. The dict is built in C first: only an object
    that lost a key to a repeat is walked in Python."""
    built = dict(pairs)
    if len(built) != len(pairs) and not twice:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen and not _same(seen[key], value):
                twice.append((built, key, seen[key], value))
                break
            seen[key] = value
    return built


def _same(a: Any, b: Any) -> bool:
    """JSON values equal as written: `1`, `1.0` and `true` differ; NaN is NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_same, a, b))
    return a == b or (a != a and b != b)


def _json_path(data: Any, held: dict, key: str) -> str:
    """The dotted path of `key` in the object `held` inside `data` (found by identity)."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        node, where = stack.pop()
        if node is held:
            return f"{where}{_json_step(key)}".removeprefix(".")
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for name, child in items if isinstance(node, (dict, list)) else ():
            if isinstance(child, (dict, list)):
                step = f"[{name}]" if isinstance(node, list) else _json_step(name)
                stack.append((child, f"{where}{step}"))
    return key


def _json_step(key: str) -> str:
    return f".{key}" if re.fullmatch(r"[\w-]+", key) else f"[{json.dumps(key)}]"


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def check_data(
    value: Any, field: str, error: type[CompressflowError] = InputError
) -> tuple[int, int]:
    """Refuse parameter data (lists, dicts) that would expand past the limits when walked;
    returns its (values, characters of text), counted as expanded.

    Python callers can build the same shared-reference bombs (and cycles) YAML aliases make.
    """
    sizes: dict[int, tuple[int, int]] = {}
    open_: set[int] = set()

    def within(nodes: int, chars: int) -> tuple[int, int]:
        shared = "once shared lists and dicts are counted each time they appear"
        if nodes > MAX_NODES:
            raise error(
                field,
                f"expands to more than the limit of {MAX_NODES:,} values {shared}",
                "pass smaller values",
            )
        if chars > MAX_TEXT_BYTES:
            raise error(
                field,
                f"holds more than the limit of {MAX_TEXT_BYTES:,} characters of text {shared}",
                "pass smaller values",
            )
        return nodes, chars

    def size_of(node: Any, depth: int) -> tuple[int, int]:
        if isinstance(node, (str, bytes)):
            return 1, len(node)
        if not isinstance(node, (dict, list, tuple)):
            return 1, 0
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_:
            raise error(field, "holds itself (a cycle), so it never ends", "pass plain values")
        if depth > MAX_DEPTH:
            raise error(
                field, f"nests deeper than the limit of {MAX_DEPTH} levels", "pass flatter values"
            )
        open_.add(key)
        nodes, chars = 1, 0
        for child in [*node.keys(), *node.values()] if isinstance(node, dict) else node:
            child_nodes, child_chars = size_of(child, depth + 1)
            nodes, chars = within(nodes + child_nodes, chars + child_chars)
        open_.discard(key)
        sizes[key] = nodes, chars
        return nodes, chars

    return within(*size_of(value, 0))


# Ceilings on a model config's core sizes, checked before the model is built on the meta device:
# far above any real model (Llama 3.1 405B: 126 layers, hidden 16384, intermediate 53248;
# vocabularies reach ~262k; Llama 4 Scout reads 10M positions), yet low enough that what a meta
# build still allocates for real (rotary buffers sized by head_dim, a module object per layer)
# stays small.
MAX_CONFIG_LAYERS = 1_000  # num_hidden_layers: 5,000 took 143 s to build on the meta device
MAX_CONFIG_SIZE = 1_000_000  # hidden, intermediate, head and vocabulary sizes, head counts
MAX_CONFIG_POSITIONS = 100_000_000  # max_position_embeddings
CONFIG_CEILINGS = {
    "num_hidden_layers": MAX_CONFIG_LAYERS,
    "hidden_size": MAX_CONFIG_SIZE,
    "intermediate_size": MAX_CONFIG_SIZE,
    "num_attention_heads": MAX_CONFIG_SIZE,
    "num_key_value_heads": MAX_CONFIG_SIZE,
    "head_dim": MAX_CONFIG_SIZE,
    "vocab_size": MAX_CONFIG_SIZE,
    "max_position_embeddings": MAX_CONFIG_POSITIONS,
}
