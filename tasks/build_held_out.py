"""Build held-out text: evaluation samples the compressed model was not calibrated on.

When the evaluation text comes from the dataset that calibrated the model (read from the
published manifest), the calibration samples are rebuilt exactly as the dataset stage drew them
(same seed, same formatting, `compressflow.data.text_sources`) and removed before sampling.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from compressflow.data.text_sources import (
    load_source,
    load_tokenizer,
    row_formatter,
    sample_texts,
    tokenize,
)
from compressflow.logs import run_logger
from compressflow.params import DatasetArgs
from compressflow.results import FetchedModel, HeldOutText
from compressflow.runtime.isolation import in_child

# DatasetArgs fields that decide which rows exist: equal ones mean the same source rows.
SOURCE_FIELDS = ("dataset_name", "dataset_config_name", "split", "text_column", "dataset_loader")


@task(name="build held-out text", cache_policy=NO_CACHE)
def build_held_out(
    args: DatasetArgs, model: FetchedModel, calibration: DatasetArgs | None
) -> HeldOutText:
    """`args.text_samples` texts from `args`' source, without the rows calibration used."""
    held_out = in_child(held_out_text, args, model, calibration)
    run_logger(__name__).info(
        "Held-out text: %d samples from %s (%d calibration rows left out)",
        len(held_out.input_ids),
        held_out.source,
        held_out.excluded_calibration_samples,
    )
    return held_out


def held_out_text(
    args: DatasetArgs, model: FetchedModel, calibration: DatasetArgs | None
) -> HeldOutText:
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
