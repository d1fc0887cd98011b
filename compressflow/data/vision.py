"""Image+text calibration rows: the model's processor, how rows go through it, how they are
stored, and how they become model inputs.

A processor's output for one image+text sample is stored as lists: token-aligned keys without
the batch dimension (so token statistics read like text rows), image tensors as the processor
shaped them (their own batch or patch dimension). The same conversion back serves the trace
check (the first sample, so the trace sees the real vision inputs) and calibration (as
oneshot's data_collator, one sample per batch).
"""

from __future__ import annotations

from typing import Any

from compressflow.data.text_sources import require_columns
from compressflow.errors import DatasetError
from compressflow.logs import run_logger
from compressflow.params import DatasetArgs
from compressflow.results import FetchedModel

# Keys aligned with the tokens: stored per sample, given a batch dimension as inputs.
TOKEN_KEYS = ("input_ids", "attention_mask", "token_type_ids", "cross_attention_mask")


def stored_row(processed: dict[str, Any]) -> dict[str, list]:
    """One processor output (return_tensors="pt", one sample) as storable lists."""
    return {k: (v[0] if k in TOKEN_KEYS else v).tolist() for k, v in processed.items()}


def model_inputs(row: dict[str, Any]) -> dict[str, Any]:
    """A stored row (text or image+text) as the tensors a forward call takes."""
    import torch

    inputs = {}
    for key, value in row.items():
        tensor = torch.tensor(value)
        inputs[key] = tensor.unsqueeze(0) if key in TOKEN_KEYS else tensor
    return inputs


def collate_one(batch: list[dict[str, Any]]) -> dict[str, Any]:
    """oneshot's data_collator for image+text rows: batches of one (images differ in shape)."""
    if len(batch) != 1:
        raise ValueError(f"image+text calibration runs one sample per batch, got {len(batch)}")
    return model_inputs(batch[0])


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
