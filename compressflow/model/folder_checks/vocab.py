"""Folder check: the tokenizer fits the model. Every id the tokenizer can produce (its vocabulary,
added and special tokens, and the token ids config.json and generation_config.json name) must be
a row of the model's input embedding, and of its output head where it has one of its own; and no
added token may take an id the vocabulary gives to another string.

A token past the rows fails as an IndexError only once text holding it is embedded (calibration,
or a server's first request for it), and a model published so can never serve it. Read from the
files alone: tokenizer.json (else vocab.json, vocab.txt, tokenizer.model or *.tiktoken),
tokenizer_config.json, added_tokens.json, special_tokens_map.json; the rows from the safetensors
headers where the weights are here (they win over config.json's vocab_size), else from the
config. `fit` is also verification's check of the output (compressflow/verification/vocab.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from compressflow.errors import ModelFetchError
from compressflow.limits import MAX_JSON_BYTES
from compressflow.model.folder_checks import Folder, FolderCheck
from compressflow.model.folder_checks.files import load_model_json
from compressflow.model.headers import tensor_index
from compressflow.model.shards import named

# A tokenizer.json past the cap on other JSON files is still parsed (Gemma 3's is 33 MB), up to
# this: a larger one is left unchecked, said so, rather than held in memory.
MAX_TOKENIZER_BYTES = 256 << 20
# The last module of an input embedding's name, across the families people bring: Llama, Qwen,
# Mistral, Gemma (`embed_tokens`), GPT-2 and MPT (`wte`), Falcon and Bloom (`word_embeddings`),
# GPT-NeoX (`embed_in`), InternLM2 (`tok_embeddings`).
INPUT_EMBEDDINGS = ("embed_tokens", "wte", "word_embeddings", "embed_in", "tok_embeddings")
# An output head's: `lm_head`, GPT-NeoX's `embed_out`, ChatGLM's `output_layer`, InternLM2's
# top-level `output`.
OUTPUT_HEADS = ("lm_head", "embed_out", "output_layer")
# Towers that are not the language model's (a vision or audio encoder's own embeddings).
OTHER_TOWERS = re.compile(r"(?:^|[._])(?:vision|visual|audio|speech|image|talker)", re.IGNORECASE)
# Rows an architecture's embedding has beyond config.json's vocab_size (transformers'
# MllamaTextModel: vocab_size + 8, for <|image|> and others no head row predicts).
EXTRA_ROWS = {"mllama": 8}
# Special tokens a tokenizer's settings name by their text.
SPECIAL_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)
LIST_KEYS = ("additional_special_tokens", "extra_special_tokens")
# Token ids the model's settings name, in config.json (and a text_config) and generation_config.
ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
FIX = (
    "give the model an embedding row for every token of its tokenizer and save both "
    "(`model.resize_token_embeddings(len(tokenizer))`, then `model.save_pretrained(folder)` and "
    "`tokenizer.save_pretrained(folder)`), or use the tokenizer the model was trained with"
)
CLASH_FIX = (
    "use the tokenizer the model was trained with, or give the added token an id of its own "
    "(past the vocabulary's, below the embedding's rows)"
)


@dataclass(frozen=True)
class Rows:
    """The rows of the input embedding and of the output head (None: unknown), and where from."""

    embedding: int | None
    head: int | None  # the head's own, when it is a tensor of its own; else the embedding's
    source: str
    note: str = ""  # why not from the headers, where they were looked at
    head_name: str = ""  # the head's tensor, where it has other rows than the embedding

    def sizes(self) -> str:
        """What the model has: "the input embedding (its source) has N rows[, its head M]"."""
        note = f"; {self.note}" if self.note else ""
        head = f", its output head ({self.head_name}) {self.head:,}" if self.head_name else ""
        return (
            f"the model's input embedding ({self.source}{note}) has {self.embedding:,} rows{head}"
        )


@dataclass(frozen=True)
class Token:
    """One id the tokenizer can produce: its text, the file and key that give it, and whether it
    is a special token (one only a special added token may hold past the head: Mllama's
    <|image|>)."""

    id: int
    text: str
    where: str
    special: bool = False


@dataclass
class Ids:
    """What the tokenizer can produce: its vocabulary (id -> text), every other id, and what
    could not be read here."""

    vocab: dict[int, str] = field(default_factory=dict)
    vocab_where: str = ""
    whole: bool = False  # the vocabulary is every token the tokenizer holds but the added ones
    tokens: list[Token] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Fit:
    """The check's outcome: the problem (None: it fits) and its fix, and what was checked."""

    problem: str | None
    fix: str
    detail: str


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _digits(text: str) -> bool:
    """An id written out: ASCII digits only (str.isdigit takes "²", which int() refuses)."""
    return text.isascii() and text.isdigit()


def _rows_of(index, names: tuple[str, ...], top: str | None = None) -> tuple[int | None, str]:
    """(rows, tensor name) of the 2-D weights whose module `names` names (or named `top`),
    where they agree; else (None, why not)."""
    found = {}
    for name, info in index.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or len(info.shape) != 2 or OTHER_TOWERS.search(name):
            continue
        if module.rpartition(".")[2] in names or name == top:
            found[name] = info.shape[0]
    if len(set(found.values())) == 1:
        return next(iter(found.values())), min(found, key=len)
    if not found:
        return None, "no tensor of the checkpoint is named as one"
    return None, f"{len(found)} tensors could be it, with different rows: {named(found.items())}"


def _config_rows(config: dict) -> int | None:
    text = config.get("text_config")
    settings = text if isinstance(text, dict) and "vocab_size" in text else config
    rows = settings.get("vocab_size")
    if not _count(rows) or not rows:
        return None
    return rows + EXTRA_ROWS.get(str(config.get("model_type")), 0)


def embedding_rows(path: Path, config: dict, headers: bool) -> Rows:
    """The embedding's and head's rows: from the safetensors headers when `headers` (the weights
    are here and whole), else, or where no tensor is plainly the embedding, from config.json."""
    note = "" if headers else "the weights are not here"
    if headers and (index := tensor_index(path)):
        rows, name = _rows_of(index, INPUT_EMBEDDINGS)
        if rows is not None:
            head, head_name = _rows_of(index, OUTPUT_HEADS, top="output.weight")
            source = f"{name}, in the safetensors headers"
            if head is None or head == rows:  # tied, or as many rows
                return Rows(rows, rows, source)
            return Rows(rows, head, source, head_name=head_name)
        note = f"the input embedding is not identified ({name})"
    rows = _config_rows(config)
    where = "text_config.vocab_size" if "vocab_size" in (config.get("text_config") or {}) else ""
    source = f"config.json's {where or 'vocab_size'}"
    return Rows(rows, rows, source if rows is not None else "unknown", note)


# ---------------------------------------------------------------- the tokenizer's ids


def _json(file: Path):
    """A tokenizer's settings file as JSON, or None where it is not here or past the cap on
    JSON files (the JSON check has refused one that does not parse)."""
    if not file.is_file() or file.stat().st_size > MAX_JSON_BYTES:
        return None
    return load_model_json(file)


def _tokenizer_json(file: Path):
    """tokenizer.json parsed, or None where it is not here, too large (over
    MAX_TOKENIZER_BYTES) or does not parse (the JSON check refuses that). orjson, which Prefect
    installs, reads a 150k vocabulary in a quarter of json's time
    (docs/benchmarks/tokenizer-fit.md)."""
    if not file.is_file() or file.stat().st_size > MAX_TOKENIZER_BYTES:
        return None
    data = file.read_bytes()
    try:
        import orjson

        return orjson.loads(data)
    except (ImportError, ValueError):  # orjson refuses what json reads: NaN, 65-bit integers
        pass
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def _bytes(file: Path) -> bytes:
    """A tokenizer file that is not JSON, read whole up to the cap (a larger one reads as none)."""
    return file.read_bytes() if file.stat().st_size <= MAX_TOKENIZER_BYTES else b""


def _vocabulary(vocab, ids: Ids, where: str) -> None:
    """A model's vocabulary: text -> id (BPE, WordPiece, WordLevel) or [text, score] by id
    (Unigram)."""
    if isinstance(vocab, dict):
        ids.vocab = {i: text for text, i in vocab.items() if _count(i)}
    elif isinstance(vocab, list):
        ids.vocab = {
            i: str(item[0] if isinstance(item, list) and item else item)
            for i, item in enumerate(vocab)
        }
    else:
        ids.unchecked.append(f"{where} (a JSON {type(vocab).__name__})")
        return
    ids.vocab_where, ids.whole = where, True


def _sentencepiece(file: Path) -> list[str] | None:
    """The pieces of a sentencepiece model (a ModelProto: field 1 repeats a SentencePiece whose
    field 1 is its text), read without the library; None where it is not one."""

    def varint(data: bytes, at: int) -> tuple[int, int]:
        value = shift = 0
        while True:
            byte = data[at]
            value |= (byte & 0x7F) << shift
            at, shift = at + 1, shift + 7
            if not byte & 0x80:
                return value, at

    def fields(data: bytes):
        at = 0
        while at < len(data):
            key, at = varint(data, at)
            kind = key & 7
            if kind == 0:
                _, at = varint(data, at)
                value = None
            elif kind == 2:
                length, at = varint(data, at)
                value, at = data[at : at + length], at + length
            elif kind in (1, 5):
                value, at = None, at + (8 if kind == 1 else 4)
            else:
                raise ValueError(kind)
            yield key >> 3, value

    try:
        data = _bytes(file)
        pieces = []
        for number, value in fields(data):
            if number == 1 and value is not None:
                text = next((v for n, v in fields(value) if n == 1 and v is not None), b"")
                pieces.append(text.decode("utf-8", "replace"))
        return pieces or None
    except (IndexError, ValueError, OSError):
        return None


def _base_vocabulary(path: Path, ids: Ids) -> dict | None:
    """The vocabulary the tokenizer loads (tokenizer.json first, as transformers); returns
    tokenizer.json's settings."""
    tokenizer_json = path / "tokenizer.json"
    data = _tokenizer_json(tokenizer_json)
    if tokenizer_json.is_file() and data is None:
        ids.unchecked.append("tokenizer.json (too large or not JSON)")
    if isinstance(data, dict):
        model = data.get("model")
        if isinstance(model, dict) and "vocab" in model:
            _vocabulary(model["vocab"], ids, "tokenizer.json model.vocab")
        return data
    if isinstance(vocab := _json(path / "vocab.json"), dict):
        _vocabulary(vocab, ids, "vocab.json")
    elif (path / "vocab.txt").is_file():
        lines = _bytes(path / "vocab.txt").decode(errors="replace").splitlines()
        _vocabulary(lines, ids, "vocab.txt")
    elif model := next(iter(sorted(path.glob("*.model"))), None):
        if (pieces := _sentencepiece(model)) is not None:
            _vocabulary(pieces, ids, model.name)
        else:
            ids.unchecked.append(f"{model.name} (not a sentencepiece model read here)")
    elif tiktoken := next(iter(sorted(path.glob("*.tiktoken"))), None):
        lines = _bytes(tiktoken).decode(errors="replace").splitlines()
        ranks = [line.split()[-1] for line in lines if line.split()]
        ids.vocab = {int(rank): f"rank {rank}" for rank in ranks if _digits(rank)}
        ids.vocab_where = tiktoken.name
        ids.unchecked.append(f"{tiktoken.name}'s special tokens (its tokenizer's code names them)")
    return None


def _text(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def tokenizer_ids(path: Path) -> Ids:
    """Every id the folder's tokenizer can produce, as its files give them."""
    ids = Ids()
    settings = _base_vocabulary(path, ids) or {}
    added = settings.get("added_tokens")
    for item in added if isinstance(added, list) else []:
        if isinstance(item, dict) and _count(item.get("id")) and _text(item):
            special = item.get("special") is True
            ids.tokens.append(
                Token(item["id"], _text(item), "tokenizer.json added_tokens", special)
            )
    config = _json(path / "tokenizer_config.json")
    config = config if isinstance(config, dict) else {}
    decoder = config.get("added_tokens_decoder")
    for key, item in decoder.items() if isinstance(decoder, dict) else []:
        if _digits(key) and _text(item):
            special = isinstance(item, dict) and item.get("special") is True
            where = "tokenizer_config.json added_tokens_decoder"
            ids.tokens.append(Token(int(key), _text(item), where, special))
    extra = _json(path / "added_tokens.json")
    for text, i in extra.items() if isinstance(extra, dict) else []:
        if _count(i):
            ids.tokens.append(Token(i, text, "added_tokens.json"))
    _special_tokens(path, config, ids)
    return ids


def _special_tokens(path: Path, config: dict, ids: Ids) -> None:
    """The special tokens the settings name by text, at the id the tokenizer gives them; one it
    does not hold is added by transformers at the next free id."""
    named_texts: list[tuple[str, str]] = []  # (text, where)
    special_map = _json(path / "special_tokens_map.json")
    for file, settings in (
        ("tokenizer_config.json", config),
        ("special_tokens_map.json", special_map if isinstance(special_map, dict) else {}),
    ):
        for key in SPECIAL_KEYS:
            if text := _text(settings.get(key)):
                named_texts.append((text, f"{file} {key}"))
        for key in LIST_KEYS:
            value = settings.get(key)
            items = list(value.values()) if isinstance(value, dict) else value
            for item in items if isinstance(items, list) else []:
                if text := _text(item):
                    named_texts.append((text, f"{file} {key}"))
    known = {text: i for i, text in ids.vocab.items()}
    known.update((token.text, token.id) for token in ids.tokens)
    after = max([*ids.vocab, *(token.id for token in ids.tokens)], default=-1) + 1
    for text, where in named_texts:
        if text not in known:
            if not ids.whole:  # which id it has is not known here (a tiktoken's code names it)
                continue
            # transformers adds it: the next id after every other
            known[text], after = after, after + 1
            where += " (not in the vocabulary: transformers adds it)"
        ids.tokens.append(Token(known[text], text, where, special=True))


def setting_ids(path: Path, config: dict) -> list[Token]:
    """The token ids config.json (and its text_config) and generation_config.json name."""
    found: list[Token] = []
    generation = _json(path / "generation_config.json")
    for file, prefix, settings in (
        ("config.json", "", config),
        ("config.json", "text_config.", config.get("text_config")),
        ("generation_config.json", "", generation),
    ):
        for key in ID_KEYS if isinstance(settings, dict) else ():
            value = settings.get(key)
            for i in value if isinstance(value, list) else [value]:
                if _count(i):  # null or -1: unset
                    found.append(Token(i, "", f"{file} {prefix}{key}"))
    return found


# ---------------------------------------------------------------- the check


def fit(path: Path, config: dict, headers: bool = True) -> Fit:
    """Whether the tokenizer in `path` fits the model's embedding (`headers`: its weights are
    here and whole, their headers give the rows)."""
    rows = embedding_rows(path, config, headers)
    ids = tokenizer_ids(path)
    tokens = ids.tokens + setting_ids(path, config)
    checked = f"{len(ids.vocab):,} vocabulary ids and {len(tokens)} others"
    unchecked = f"; not checked: {', '.join(ids.unchecked)}" if ids.unchecked else ""
    if rows.embedding is None:
        note = f" ({rows.note})" if rows.note else ""
        detail = f"not checked: the embedding's rows are not known{note}"
        return Fit(None, FIX, detail + unchecked)
    sizes = rows.sizes()
    if ids.vocab:
        top = max(ids.vocab)
        if top >= rows.embedding or top >= rows.head:
            bound = min(rows.embedding, rows.head)
            past = sum(1 for i in ids.vocab if i >= bound)
            return Fit(
                f"the tokenizer's vocabulary ({ids.vocab_where}) has ids up to {top:,} "
                f"({past:,} of its {len(ids.vocab):,} tokens at or past row {bound:,}, e.g. "
                f"{ids.vocab[top]!r:.60} = {top:,}), but {sizes}; text holding one of them "
                "fails with an IndexError when it is embedded",
                FIX,
                "",
            )
    top = max([*ids.vocab, *(token.id for token in tokens)], default=0)
    bound = min(rows.embedding, rows.head)
    for token in tokens:
        # Rows the embedding has beyond the head are input-only by the model's design: a special
        # token may sit there (Mllama's <|image|>), nothing the model must predict.
        input_only = token.special and rows.head <= token.id < rows.embedding
        if token.id >= rows.embedding or (token.id >= rows.head and not input_only):
            what = f"gives the token {token.text!r:.60} the id" if token.text else "names the id"
            return Fit(
                f"{token.where} {what} {token.id:,}, but {sizes}: the tokenizer has ids "
                f"up to {top:,}, the model has rows for ids 0 to {bound - 1:,}; text holding the token "
                "fails with an IndexError when it is embedded, and no server can use it",
                FIX,
                "",
            )
        if token.where.endswith(("added_tokens", "added_tokens_decoder", "added_tokens.json")):
            other = ids.vocab.get(token.id)
            if other is not None and other != token.text:
                return Fit(
                    f"{token.where} gives the id {token.id:,} to the token {token.text!r:.60}, "
                    f"which the vocabulary ({ids.vocab_where}) gives to {other!r:.60}: one id "
                    "for two tokens decodes as either",
                    CLASH_FIX,
                    "",
                )
    return Fit(None, FIX, f"{checked} fit: {sizes}{unchecked}")


def check_fit(folder: Folder) -> None:
    """Refuse a tokenizer that does not fit the model (`fit`)."""
    found = fit(folder.path, folder.config, headers=bool(folder.names))
    if found.problem:
        raise ModelFetchError("model.model_id", f"{folder.path}: {found.problem}", found.fix)


# After the weight files' checks, whose tensor names say the headers are whole.
VOCAB = FolderCheck("tokenizer fits", "model.model_id", check_fit)
