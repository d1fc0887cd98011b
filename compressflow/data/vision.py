"""Image+text calibration rows: how they are stored, and how they become model inputs.

A processor's output for one image+text sample is stored as lists: token-aligned keys without
the batch dimension (so token statistics read like text rows), image tensors as the processor
shaped them (their own batch or patch dimension). The same conversion back serves the trace
check (the first sample, so the trace sees the real vision inputs) and calibration (as
oneshot's data_collator, one sample per batch).
"""

from __future__ import annotations

from typing import Any

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
