"""Build dataset: samples, templates and tokenizes the calibration data, and caches it.

Where rows come from and how they become text is `compressflow.data.text_sources`. Rows are sampled
with `seed`, turned into text (chat messages through the model's chat template), tokenized
without padding and truncated to `max_seq_len`, then saved with `save_to_disk` under
`$COMPRESSFLOW_CACHE_DIR/datasets/<fingerprint>`. The fingerprint is a hash of the tokens, so the
same data built twice lands in, and reuses, the same folder.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from prefect import task

from compressflow.data.text_sources import (
    load_source,
    load_tokenizer,
    require_columns,
    row_formatter,
    sample_texts,
    tokenize,
    tokenizer_identity,
)
from compressflow.data.user_code import import_callable
from compressflow.data.vision import stored_row
from compressflow.errors import DatasetError
from compressflow.logs import run_logger
from compressflow.params import DatasetArgs
from compressflow.reporting import tracking
from compressflow.results import BuiltDataset, FetchedModel
from compressflow.runtime.isolation import in_child
from compressflow.store.caching import CACHE_EXPIRATION, LocalSourceAware, cache_root
from compressflow.store.identity import dataset_fingerprint


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
    built = in_child(build, args, model)
    stats = built.token_stats
    logger.info(
        "Built %d samples from %s: %d to %d tokens (mean %.0f, total %d), chat template %s; %s",
        built.num_samples,
        built.source,
        stats["min"],
        stats["max"],
        stats["mean"],
        stats["total"],
        "applied" if built.chat_template_applied else "not applied",
        built.path,
    )
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


def load_vision_processor(args: DatasetArgs, model: FetchedModel):
    """The model's processor, or a DatasetError when it has no image processor."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(
            model.path, trust_remote_code=model.trust_remote_code
        )
    except ImportError as exc:  # e.g. Qwen2.5-VL's processor needs torchvision
        raise DatasetError(
            "dataset.vision_samples",
            f"the processor of {model.model_id} cannot be built here: "
            + (str(exc).strip().split(". ")[0] or type(exc).__name__),
            "install what it names on the worker (no torchvision wheel loads beside the CPU "
            "torch these workers use), or calibrate on text with vision_samples=0",
        ) from exc
    except (OSError, ValueError) as exc:  # no processor files at all
        run_logger(__name__).debug("AutoProcessor failed for %s: %s", model.path, exc)
        processor = None
    if getattr(processor, "image_processor", None) is None:
        raise DatasetError(
            "dataset.vision_samples",
            f"vision_samples={args.vision_samples} needs an image processor, but the model "
            f"{model.model_id} has no processor with one (it is a text-only model)",
            "set vision_samples=0, or pick a vision-language model",
        )
    return processor


# --- loading ------------------------------------------------------------------------------------


# --- rows to text -------------------------------------------------------------------------------


# --- tokenizing ---------------------------------------------------------------------------------


def process_vision_rows(dataset, args: DatasetArgs, entry: dict | None, processor, source: str):
    """`vision_samples` image+caption rows through the processor (flickr-style rows)."""
    columns = dataset.column_names
    entry = entry or {}
    image_column = entry.get("image_column") or ("images" if "images" in columns else "image")
    caption_column = (
        args.text_column
        or entry.get("column")
        or ("text" if "text" in columns and "caption" not in columns else "caption")
    )
    require_columns([image_column, caption_column], columns, source)
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
            return_tensors="pt",
        )
        return stored_row(out)

    return rows.map(encode, remove_columns=columns, keep_in_memory=True)


# --- output -------------------------------------------------------------------------------------


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
