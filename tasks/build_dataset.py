"""Build dataset: loads, samples, templates and tokenizes the calibration data.

Sources, tried in this order:
1. `dataset_loader` (`module:function`, imported, called with the DatasetArgs, must return a
   `datasets.Dataset`);
2. a shortcut from `tasks.dataset_registry` (e.g. `python_docs`, `gsm8k`, `ultrachat_200k`);
3. a local file or folder: `.txt` (one sample per paragraph, i.e. blocks separated by blank
   lines, so samples are coherent text rather than single lines), `.jsonl`/`.json`, `.parquet`,
   `.csv`, or a folder of such files;
4. anything else is a hub dataset id for `datasets.load_dataset`, which honours HF_HUB_OFFLINE
   and the local cache under HF_HOME.

Rows are sampled with `seed`, turned into text (chat messages through the model's chat template),
tokenized without padding and truncated to `max_seq_len`, then saved with `save_to_disk` under
`$COMPRESSFLOW_CACHE_DIR/datasets/<fingerprint>`. The fingerprint is a hash of the tokens, so the
same data built twice lands in, and reuses, the same folder.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import re
import shutil
import string
import tempfile
from pathlib import Path
from typing import Any, Callable

from prefect import task
from pydantic import BaseModel, Field

from flows.params import DatasetArgs
from tasks import tracking
from tasks.caching import CACHE_EXPIRATION, LocalSourceAware, cache_root
from tasks.dataset_registry import ALIASES, SHAREGPT_ROLES, SHORTCUTS, lookup
from tasks.errors import DatasetError
from tasks.fetch_model import FetchedModel
from tasks.imports import import_callable
from tasks.logs import run_logger

log = logging.getLogger(__name__)

# Suffixes read as local files, and the `datasets` builder for each (.txt is read here).
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
FILE_SUFFIXES = {*FILE_BUILDERS, ".txt"}


class BuiltDataset(BaseModel):
    path: str = Field(description="datasets.save_to_disk folder with input_ids and attention_mask.")
    fingerprint: str = Field(description="sha256 over the tokenized samples and how they were made.")
    source: str = Field(description="Where the rows came from, e.g. 'shortcut:python_docs'.")
    num_samples: int
    token_stats: dict[str, float] = Field(description="min, mean, max and total tokens per sample.")
    chat_template_applied: bool = False

    def exists(self) -> bool:
        return Path(self.path, "dataset_info.json").exists()

    def log_to(self, tracker) -> None:
        tracker.params("dataset", self.tracking_params())

    def tracking_params(self) -> dict:
        return {
            "source": self.source,
            "fingerprint": self.fingerprint,
            "samples": self.num_samples,
            "chat_template_applied": self.chat_template_applied,
            **{f"tokens_{name}": value for name, value in self.token_stats.items()},
        }


@task(
    name="build dataset",
    cache_policy=LocalSourceAware(),
    cache_expiration=CACHE_EXPIRATION,
    persist_result=True,
)
def build_dataset(
    args: DatasetArgs, model: FetchedModel, needs_data: bool = True
) -> BuiltDataset | None:
    """Build the calibration dataset for `model`, or return None when the recipe needs none."""
    logger = run_logger(__name__)
    if not needs_data:
        logger.info("The recipe needs no calibration data: no dataset is built")
        return None
    if args.text_samples == 0 and args.vision_samples == 0:
        raise DatasetError(
            "dataset.text_samples",
            "the recipe needs calibration data but text_samples and vision_samples are both 0",
            "set text_samples (e.g. 256) or, for a vision-language model, vision_samples",
        )
    built = build(args, model)
    stats = built.token_stats
    logger.info(
        "Built %d samples from %s: %d to %d tokens (mean %.0f, total %d), chat template %s; %s",
        built.num_samples, built.source, stats["min"], stats["max"], stats["mean"], stats["total"],
        "applied" if built.chat_template_applied else "not applied", built.path,
    )  # fmt: skip
    tracking.log_result(built)
    return built


def build(args: DatasetArgs, model: FetchedModel) -> BuiltDataset:
    """Load, sample, render and tokenize; cheap checks on the model run before any data loads."""
    check_max_seq_len(args, model)
    if args.data_collator:  # used only at calibration: check it now, before weights load
        import_callable(args.data_collator, "dataset.data_collator", DatasetError, call_with=([],))
    processor = load_vision_processor(args, model) if args.vision_samples else None
    tokenizer = load_tokenizer(model)
    # Before tokenizing: transformers leaves truncation settings on the tokenizer's backend.
    tokenizer_id = tokenizer_identity(tokenizer)
    dataset, source, entry = load_source(args)

    if processor is not None:
        if args.text_samples:
            log.warning("vision_samples is set: the dataset holds image rows only; "
                        "text_samples=%d is unused", args.text_samples)  # fmt: skip
        tokenized = process_vision_rows(dataset, args, entry, processor, source)
        templated = True
    else:
        if entry and entry["format"] == "image_caption":
            raise DatasetError(
                "dataset.vision_samples",
                f"'{args.dataset_name}' is an image dataset but vision_samples is 0",
                "set vision_samples > 0 with a vision-language model, or pick a text dataset",
            )
        format_row, templated = row_formatter(dataset, args, entry, tokenizer, source)
        texts = sample_texts(dataset, format_row, args.text_samples, args.seed, source)
        # A chat template writes the model's special tokens itself (as the serving engine sees
        # them); adding BOS again would calibrate on sequences the model never gets.
        tokenized = tokenize(texts, tokenizer, args.max_seq_len, add_special_tokens=not templated)

    fp = fingerprint(tokenized, tokenizer_id, args.max_seq_len)
    path = save(tokenized, fp)
    return BuiltDataset(
        path=str(path),
        fingerprint=fp,
        source=source,
        num_samples=len(tokenized),
        token_stats=token_stats(tokenized),
        chat_template_applied=templated,
    )


# --- model-side checks --------------------------------------------------------------------------


def check_max_seq_len(args: DatasetArgs, model: FetchedModel) -> None:
    """Refuse samples longer than the model's position embeddings: they would not calibrate."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    text_config = config.get_text_config()  # vision-language configs nest the language model's
    limit = getattr(text_config, "max_position_embeddings", None) or getattr(
        text_config, "n_positions", None
    )
    if limit is not None and args.max_seq_len > limit:
        raise DatasetError(
            "dataset.max_seq_len",
            f"max_seq_len={args.max_seq_len} exceeds the model's maximum of {limit} positions "
            f"(max_position_embeddings of {model.model_id})",
            f"set max_seq_len to at most {limit}",
        )


def load_tokenizer(model: FetchedModel):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)


def load_vision_processor(args: DatasetArgs, model: FetchedModel):
    """The model's processor, or a DatasetError when it has no image processor."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(
            model.path, trust_remote_code=model.trust_remote_code
        )
    except (OSError, ValueError) as exc:  # no processor files at all
        log.debug("AutoProcessor failed for %s: %s", model.path, exc)
        processor = None
    if getattr(processor, "image_processor", None) is None:
        raise DatasetError(
            "dataset.vision_samples",
            f"vision_samples={args.vision_samples} needs an image processor, but the model "
            f"{model.model_id} has no processor with one (it is a text-only model)",
            "set vision_samples=0, or pick a vision-language model",
        )
    return processor


def tokenizer_identity(tokenizer) -> str:
    """Hash of the vocabulary, merges, normalizer and chat template: what decides the tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        vocab = backend.to_str()
    else:  # slow tokenizer
        vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
    template = str(getattr(tokenizer, "chat_template", None))
    text = "\n".join([type(tokenizer).__name__, vocab, template])
    return hashlib.sha256(text.encode()).hexdigest()


# --- loading ------------------------------------------------------------------------------------


def load_source(args: DatasetArgs):
    """(dataset, readable source, registry entry or None) for the DatasetArgs."""
    import datasets

    if args.dataset_loader:
        return call_loader(args.dataset_loader, args), f"loader:{args.dataset_loader}", None

    name = args.dataset_name
    entry = lookup(name)
    if entry is not None:
        shortcut = ALIASES.get(name, name)
        if entry["format"] == "audio":
            raise DatasetError(
                "dataset.dataset_name",
                f"'{name}' is an audio dataset; compressflow builds text and image samples only",
                "pick a text dataset, or pass a dataset_loader returning processor-ready rows",
            )
        if "local_rows" in entry:
            rows = import_callable(entry["local_rows"], "dataset.dataset_name", DatasetError, trusted=True)()
            return datasets.Dataset.from_dict({"text": rows}), f"shortcut:{shortcut}", entry
        split = args.split or entry["split"]
        split = entry.get("split_aliases", {}).get(split, split)
        config = args.dataset_config_name or entry.get("config")
        dataset = load_hub(entry["hub_id"], config, split, entry.get("data_files"), shortcut)
        return dataset, f"shortcut:{shortcut} ({entry['hub_id']}, split {split})", entry

    path = Path(name).expanduser()
    if path.exists():
        return load_local(path, args.split or "train"), f"file:{path.resolve()}", None
    if looks_like_path(name):
        raise DatasetError(
            "dataset.dataset_name",
            f"local file '{name}' does not exist (looked at {path.resolve()})",
            "fix the path (relative paths start from the worker's working directory), "
            f"or use a shortcut: {', '.join(SHORTCUTS)}",
        )
    split = args.split or "train"
    dataset = load_hub(name, args.dataset_config_name, split)
    config = f", config {args.dataset_config_name}" if args.dataset_config_name else ""
    return dataset, f"hub:{name} (split {split}{config})", None


def looks_like_path(name: str) -> bool:
    """A known file suffix, a leading ./ / ~, a backslash or more than one '/' mean a file path.

    `owner/name` and bare names are hub ids.
    """
    return (
        Path(name).suffix.lower() in FILE_SUFFIXES
        or name.startswith((".", "/", "~"))
        or "\\" in name
        or name.count("/") > 1
    )


def load_local(path: Path, split: str):
    """A local file or folder of data files as a Dataset."""
    import datasets

    if path.suffix.lower() == ".txt":
        paragraphs = [p.strip() for p in re.split(r"\n\s*\n", path.read_text(encoding="utf-8"))]
        return datasets.Dataset.from_dict({"text": [p for p in paragraphs if p]})
    if path.is_dir():
        return datasets.load_dataset(str(path), split=split)
    builder = FILE_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DatasetError(
            "dataset.dataset_name",
            f"'{path}' has the suffix '{path.suffix}', which compressflow cannot read",
            f"convert it to one of {', '.join(sorted(FILE_SUFFIXES))}",
        )
    return datasets.load_dataset(builder, data_files=str(path), split=split)


def load_hub(
    name: str, config: str | None, split: str, data_files=None, shortcut: str | None = None
):
    """`datasets.load_dataset` with its failures turned into messages that say what to do."""
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    nearest = ", ".join(nearest_shortcuts(name))
    try:
        return datasets.load_dataset(name, config, split=split, data_files=data_files)
    except ConnectionError as exc:  # offline (HF_HUB_OFFLINE) or unreachable, and not cached
        if shortcut:
            fix = (
                "run once where the hub is reachable to fill the cache, or use 'python_docs' "
                "(works offline) or a local file"
            )
        else:
            fix = f"check the name; nearest shortcuts: {nearest}; or use a local file"
        raise DatasetError(
            "dataset.dataset_name",
            f"the Hugging Face Hub is unreachable for dataset '{name}' ({exc}) and the local cache "
            f"({datasets.config.HF_DATASETS_CACHE}) lacks it",
            fix,
        ) from exc
    except (DatasetNotFoundError, FileNotFoundError) as exc:
        raise DatasetError(
            "dataset.dataset_name",
            f"dataset '{name}' was not found: {exc}",
            f"check the hub id and your access to it; nearest shortcuts: {nearest}",
        ) from exc
    except ValueError as exc:  # unknown split or configuration
        field = "dataset.split" if "split" in str(exc).lower() else "dataset.dataset_config_name"
        raise DatasetError(
            field,
            f"dataset '{name}' rejects split={split!r}, config={config!r}: {exc}",
            f"set {field.split('.')[1]} to one that the message lists",
        ) from exc


def nearest_shortcuts(name: str) -> list[str]:
    """Shortcut names closest to `name` (all of them when none is close)."""
    candidates = [*SHORTCUTS, *ALIASES]
    close = difflib.get_close_matches(name.split("/")[-1].lower(), candidates, n=3, cutoff=0.5)
    return close or list(SHORTCUTS)


def call_loader(spec: str, args: DatasetArgs):
    """Import `module:function`, call it with `args`, and check it returned a datasets.Dataset."""
    import datasets

    field = "dataset.dataset_loader"
    result = import_callable(spec, field, DatasetError, call_with=(args,))(args)
    if not isinstance(result, datasets.Dataset):
        raise DatasetError(
            field,
            f"'{spec}' returned a {type(result).__name__}, not a datasets.Dataset",
            "return a datasets.Dataset (from a DatasetDict, return one split, e.g. dd['train'])",
        )
    return result


# --- rows to text -------------------------------------------------------------------------------


def row_formatter(dataset, args: DatasetArgs, entry: dict | None, tokenizer, source: str):
    """(function turning a row into one text sample, whether a chat template renders them)."""
    columns = dataset.column_names
    if entry is not None and entry["format"] == "template" and not args.text_column:
        templates = entry["templates"]
        fields = [[f for _, f, _, _ in string.Formatter().parse(t) if f] for t in templates]
        _require_columns(fields[-1], columns, source)  # the fallback template must always fit
        return (lambda row: _fill_template(row, templates, fields)), False

    column = args.text_column or (entry or {}).get("column")
    if column is None:
        column = next((c for c in ("text", "messages") if c in columns), "text")
    _require_columns([column], columns, source)
    if _holds_messages(dataset, column, source):
        has_template = getattr(tokenizer, "chat_template", None) is not None
        return (lambda row: render_messages(row[column], tokenizer)), has_template
    return (lambda row: row[column] or ""), False


def _require_columns(needed: list[str], columns: list[str], source: str) -> None:
    missing = [c for c in needed if c not in columns]
    if missing:
        raise DatasetError(
            "dataset.text_column",
            f"column {', '.join(repr(c) for c in missing)} is not in {source}; its columns are: "
            f"{', '.join(columns)}",
            "set text_column to the column holding the text or chat messages",
        )


def _holds_messages(dataset, column: str, source: str) -> bool:
    """True for chat messages (a list of dicts), False for text, judged by the first value set."""
    value = next((v for v in dataset.select(range(min(len(dataset), 100)))[column] if v), "")
    if isinstance(value, str):
        return False
    if isinstance(value, list) and isinstance(value[0], dict):
        return True
    raise DatasetError(
        "dataset.text_column",
        f"column '{column}' of {source} holds {type(value).__name__} values, not text or "
        "chat messages",
        "set text_column to a column of strings or of [{role, content}, ...] lists",
    )


def _fill_template(row: dict[str, Any], templates: list[str], fields: list[list[str]]) -> str:
    """The first template whose fields are all non-empty in `row`; the last one otherwise."""
    index = next((i for i, names in enumerate(fields) if all(row.get(n) for n in names)), -1)
    return templates[index].format(**{name: row.get(name) or "" for name in fields[index]})


def render_messages(messages: list[dict], tokenizer) -> str:
    """Chat messages as the model sees them: its chat template, else plain 'role: content' lines."""
    messages = [
        {"role": SHAREGPT_ROLES.get(m.get("role") or m.get("from"), m.get("role") or m.get("from")),
         "content": m.get("content", m.get("value"))}
        for m in messages
    ]  # fmt: skip
    if getattr(tokenizer, "chat_template", None) is not None:
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def sample_texts(dataset, format_row: Callable, n: int, seed: int, source: str) -> list[str]:
    """`n` non-empty texts from rows in a seeded random order: same seed, same samples."""
    if n > len(dataset):
        raise DatasetError(
            "dataset.text_samples",
            f"text_samples={n} but {source} holds only {len(dataset)} rows",
            f"set text_samples to at most {len(dataset)}, or pick a larger dataset or split",
        )
    texts: list[str] = []
    # Rows are rendered lazily: only as many as needed, skipping empty ones (e.g. wikitext's).
    for row in dataset.shuffle(seed=seed, keep_in_memory=True):
        text = format_row(row)
        if text.strip():
            texts.append(text)
            if len(texts) == n:
                return texts
    raise DatasetError(
        "dataset.text_samples",
        f"text_samples={n} but {source} holds only {len(texts)} non-empty rows of {len(dataset)}",
        f"set text_samples to at most {len(texts)}, or pick a larger dataset or split",
    )


# --- tokenizing ---------------------------------------------------------------------------------


def tokenize(texts: list[str], tokenizer, max_seq_len: int, add_special_tokens: bool):
    """input_ids and attention_mask per text: truncated to max_seq_len, unpadded, batched."""
    import datasets

    def encode(batch):
        return tokenizer(
            batch["text"],
            max_length=max_seq_len,
            truncation=True,
            add_special_tokens=add_special_tokens,
            return_token_type_ids=False,
        )

    return datasets.Dataset.from_dict({"text": texts}).map(
        encode,
        batched=True,
        remove_columns=["text"],
        keep_in_memory=True,
        # In memory, nothing is cached by this key; a fixed one spares hashing the tokenizer.
        new_fingerprint=hashlib.sha256(f"{len(texts)}:{max_seq_len}".encode()).hexdigest()[:16],
    )


def process_vision_rows(dataset, args: DatasetArgs, entry: dict | None, processor, source: str):
    """`vision_samples` image+caption rows through the processor (flickr-style rows)."""
    columns = dataset.column_names
    entry = entry or {}
    image_column = entry.get("image_column") or ("images" if "images" in columns else "image")
    caption_column = args.text_column or entry.get("column") or (
        "text" if "text" in columns and "caption" not in columns else "caption"
    )
    _require_columns([image_column, caption_column], columns, source)
    if getattr(processor, "chat_template", None) is None:
        raise DatasetError(
            "dataset.vision_samples",
            "the model's processor has no chat template, so there is no known place for the image "
            "in the prompt",
            "use a vision-language model whose processor has a chat template, or a dataset_loader",
        )
    if args.vision_samples > len(dataset):
        raise DatasetError(
            "dataset.vision_samples",
            f"vision_samples={args.vision_samples} but {source} holds only {len(dataset)} rows",
            f"set vision_samples to at most {len(dataset)}",
        )
    rows = dataset.shuffle(seed=args.seed, keep_in_memory=True).select(range(args.vision_samples))

    def encode(row):
        caption = row[caption_column]
        question = [{"type": "image"}, {"type": "text", "text": "What does this image show?"}]
        answer = " ".join(caption) if isinstance(caption, list) else caption  # flickr: 5 captions
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        text = processor.apply_chat_template(messages, tokenize=False)
        out = processor(
            text=[text],
            images=[row[image_column]],
            max_length=args.max_seq_len,
            truncation=True,
            add_special_tokens=False,  # the chat template wrote them
        )
        # One row per call: drop the batch dimension the processor adds to list outputs.
        return {k: v[0] if isinstance(v, list) and len(v) == 1 else v for k, v in out.items()}

    return rows.map(encode, remove_columns=columns, keep_in_memory=True)


# --- output -------------------------------------------------------------------------------------


def fingerprint(tokenized, tokenizer_id: str, max_seq_len: int) -> str:
    """sha256 over every column (tokens, masks, processor tensors) and how they were made."""
    import numpy as np

    digest = hashlib.sha256(f"{tokenizer_id}\nmax_seq_len={max_seq_len}\n".encode())
    for batch in tokenized.with_format("numpy").iter(batch_size=256):
        for column in sorted(batch):
            for value in batch[column]:
                array = np.asarray(value)
                digest.update(f"{column}:{array.shape}:{array.dtype}\n".encode())
                digest.update(array.tobytes())
    return digest.hexdigest()


def save(tokenized, fp: str) -> Path:
    """save_to_disk into datasets/<fp>, via a temp sibling renamed at the end; reuse if present."""
    final = cache_root() / "datasets" / fp
    if (final / "dataset_info.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # A crash leaves only a hidden temp folder behind, never a half-written `final`.
    temp = Path(tempfile.mkdtemp(prefix=f".{fp}.", dir=final.parent))
    try:
        tokenized.save_to_disk(str(temp))
        temp.rename(final)
    except OSError:
        if not (final / "dataset_info.json").exists():
            raise
        # another run saved the same fingerprint first: its copy is identical
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return final


def token_stats(tokenized) -> dict[str, float]:
    lengths = [len(ids) for ids in tokenized["input_ids"]]
    total = sum(lengths)
    return {"min": min(lengths), "mean": total / len(lengths), "max": max(lengths), "total": total}


