"""The calibration dataset: samples, templates and tokenizes the rows, and saves them.

Where rows come from and how they become text is `compressflow.data.text_sources`, the tokenizer
`compressflow.data.tokenizer`; image+text rows are `compressflow.data.vision`. Rows are sampled
with `seed`, turned into text (chat messages through the model's chat template), tokenized
without padding and truncated to `max_seq_len`, then saved with `save_to_disk` under
`<folder>/<fingerprint>`. The fingerprint is a hash of the tokens, so the same data built twice
lands in, and reuses, the same folder; it and the tokenizer's identity it covers are
`compressflow.store.identity`'s. The build dataset stage passes the folder
(`$COMPRESSFLOW_CACHE_DIR/datasets`).

The held-out texts the evaluation scores (`held_out_text`) come from a source the same way, less
the rows the calibration build drew from it when both read the same source.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from compressflow.data.text_sources import load_source, row_formatter, sample_texts
from compressflow.data.tokenizer import load_tokenizer, tokenize
from compressflow.data.user_code import import_callable
from compressflow.data.vision import load_vision_processor, model_inputs, process_vision_rows
from compressflow.errors import DatasetError
from compressflow.logs import run_logger
from compressflow.params import DatasetArgs
from compressflow.results import BuiltDataset, FetchedModel, HeldOutText
from compressflow.store.identity import dataset_fingerprint, tokenizer_identity


def build(args: DatasetArgs, model: FetchedModel, folder: Path) -> BuiltDataset:
    """Load, sample, render and tokenize; cheap checks on the model run before any data loads.
    The dataset's fingerprint names the saved copy under `folder`."""
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
            run_logger(__name__).warning(
                "vision_samples is set: the dataset holds image rows only; "
                "text_samples=%d is unused",
                args.text_samples,
            )
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

    fp = dataset_fingerprint(tokenized, tokenizer_id, args.max_seq_len)
    path = save(tokenized, fp, folder)
    return BuiltDataset(
        path=str(path),
        fingerprint=fp,
        source=source,
        num_samples=len(tokenized),
        token_stats=token_stats(tokenized),
        chat_template_applied=templated,
    )


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


def save(tokenized, fp: str, folder: Path) -> Path:
    """save_to_disk into <folder>/<fp>, via a temp sibling renamed at the end; reuse if present."""
    final = folder / fp
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


def first_sample(dataset: BuiltDataset) -> dict[str, Any]:
    """The dataset's first row as the tensors the pipeline's dataloader yields: a trace with
    image+text rows sees the real vision inputs."""
    from datasets import load_from_disk

    return model_inputs(load_from_disk(dataset.path)[0])


# DatasetArgs fields that decide which rows exist: equal ones mean the same source rows.
SOURCE_FIELDS = ("dataset_name", "dataset_config_name", "split", "text_column", "dataset_loader")


def held_out_text(
    args: DatasetArgs, model: FetchedModel, calibration: DatasetArgs | None
) -> HeldOutText:
    """`args.text_samples` evaluation texts from `args`' source, without the rows `calibration`
    drew from it (the build held-out text stage's child)."""
    tokenizer = load_tokenizer(model)
    dataset, source, entry = load_source(args)
    format_row, templated = row_formatter(dataset, args, entry, tokenizer, source)
    excluded = 0
    same_source = calibration is not None and all(
        getattr(calibration, f) == getattr(args, f) for f in SOURCE_FIELDS
    )
    if same_source and calibration.text_samples:
        # The dataset stage's own sampling, rerun: the exact texts the model was calibrated on.
        used = set(
            sample_texts(dataset, format_row, calibration.text_samples, calibration.seed, source)
        )
        before = len(dataset)
        dataset = dataset.filter(
            lambda row: format_row(row) not in used,
            keep_in_memory=True,
            new_fingerprint="held-out",  # in memory; spares datasets hashing the closure
        )
        excluded = before - len(dataset)
    texts = sample_texts(dataset, format_row, args.text_samples, args.seed, source)
    tokenized = tokenize(texts, tokenizer, args.max_seq_len, add_special_tokens=not templated)
    return HeldOutText(
        source=source,
        input_ids=[ids for ids in tokenized["input_ids"] if len(ids) > 1],
        excluded_calibration_samples=excluded,
    )
