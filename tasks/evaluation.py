"""Evaluation: how much a compressed model lost against its base model, on held-out text.

Both models read the same tokenized samples. Per next-token position we take the base model's
distribution P and the compressed model's Q and report:

- perplexity of each (exp of the mean negative log-likelihood of the actual next token);
- KL(P || Q), averaged over positions: how far the compressed model's whole distribution moved,
  which catches damage that perplexity averages away;
- top-1 agreement: how often both models rank the same next token first.

Held-out means not calibrated on: when the evaluation text comes from the dataset that calibrated
the model (read from the published manifest), the calibration samples are rebuilt exactly as the
dataset stage drew them (same seed, same formatting) and removed before sampling.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from pydantic import BaseModel, Field

from flows.params import DatasetArgs, ModelArgs
from tasks.build_dataset import (
    load_source,
    load_tokenizer,
    row_formatter,
    sample_texts,
    tokenize,
)
from tasks.errors import CompressflowError, InputError, ModelFetchError
from tasks.fetch_model import FetchedModel, fetch_from_clearml, fetch_from_hub
from tasks.publish import read_manifest

# DatasetArgs fields that decide which rows exist: equal ones mean the same source rows.
SOURCE_FIELDS = ("dataset_name", "dataset_config_name", "split", "text_column", "dataset_loader")


class QualityThresholdExceeded(CompressflowError):
    """The compressed model lost more quality than the evaluation's thresholds allow."""


class HeldOutText(BaseModel):
    source: str
    input_ids: list[list[int]] = Field(description="One tokenized sample per entry, unpadded.")
    excluded_calibration_samples: int = Field(
        description="Rows left out because the compressed model was calibrated on them."
    )


class QualityMetrics(BaseModel):
    samples: int
    tokens: int = Field(description="Next-token positions scored.")
    base_perplexity: float
    compressed_perplexity: float
    perplexity_increase_pct: float = Field(description="100 * (compressed / base - 1).")
    kl_divergence: float = Field(description="Mean KL(base || compressed) per position, in nats.")
    top1_agreement: float = Field(description="Share of positions where both pick the same token.")


class EvaluationReport(BaseModel):
    """What evaluate-model returns. It lives here, not in the flow module: a worker loads the flow
    file by path (as module `evaluate`), and a result pickled from there would not unpickle
    in the process that reads it (e.g. a sweep)."""

    compressed_path: str
    base_identity: str
    scheme: str | None
    held_out_source: str
    excluded_calibration_samples: int
    metrics: QualityMetrics
    lm_eval: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="{'base' | 'compressed': {'<task>/<metric>': value}}."
    )
    breaches: list[str] = Field(description="Thresholds passed; empty when within limits.")
    passed: bool
    tracking: str | None = Field(default=None, description="Where ClearML logged the run.")


def published_manifest(path: str) -> dict:
    """The manifest compress-model wrote beside the checkpoint; {} for models from elsewhere."""
    return read_manifest(Path(path)) or {}


def base_model_args(manifest: dict) -> ModelArgs | None:
    """The ModelArgs the compressed model was made from, as the manifest recorded them."""
    model = manifest.get("inputs", {}).get("model")
    return ModelArgs(**model) if model else None


def calibration_args(manifest: dict) -> DatasetArgs | None:
    """The calibration DatasetArgs, or None when the recipe used no data (e.g. FP8_DYNAMIC)."""
    if not manifest.get("dataset"):
        return None
    return DatasetArgs(**manifest["inputs"]["dataset"])


def resolve_compressed(args: ModelArgs) -> Path:
    """The compressed model's local folder: a path, a ClearML model id, or a hub id.

    Not `fetch`: that refuses quantized models, which is exactly what is evaluated here.
    """
    if args.clearml_model:
        return fetch_from_clearml(args)
    local = Path(args.model_id).expanduser()
    if local.exists():
        return local.resolve()
    if args.model_id.startswith((".", "/", "~")):
        raise ModelFetchError(
            "compressed.model_id",
            f"{args.model_id} does not exist on this worker",
            "publish to storage every worker mounts (see the OutputSettings block), or pass a "
            "ClearML model id with clearml_model: true",
        )
    return fetch_from_hub(args)[0]


def check_lm_eval(tasks: list[str]) -> None:
    """Fail before any model loads when lm-eval tasks are asked for but lm-eval is missing."""
    if tasks and importlib.util.find_spec("lm_eval") is None:
        raise InputError(
            "lm_eval.tasks",
            f"lm-eval tasks {tasks} were requested but lm-eval is not installed on this worker",
            "pip install lm-eval on the worker, or leave lm_eval.tasks empty",
        )


@task(name="build held-out text", cache_policy=NO_CACHE)
def build_held_out(
    args: DatasetArgs, model: FetchedModel, calibration: DatasetArgs | None
) -> HeldOutText:
    """`args.text_samples` texts from `args`' source, without the rows calibration used."""
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
    held_out = HeldOutText(
        source=source,
        input_ids=[ids for ids in tokenized["input_ids"] if len(ids) > 1],
        excluded_calibration_samples=excluded,
    )
    get_run_logger().info(
        "Held-out text: %d samples from %s (%d calibration rows left out)",
        len(held_out.input_ids), source, excluded,
    )  # fmt: skip
    return held_out


def load_causal_lm(path: str, model_class: str, trust_remote_code: bool):
    """A model for inference: spread over the visible GPUs when there are any, else CPU."""
    import torch
    import transformers

    model = getattr(transformers, model_class).from_pretrained(
        path,
        dtype="auto",
        device_map="auto" if torch.cuda.is_available() else None,
        trust_remote_code=trust_remote_code,
    )
    return model.eval()


def score(base, compressed, input_ids: list[list[int]]) -> QualityMetrics:
    """Perplexities, KL(base || compressed) and top-1 agreement over every next-token position."""
    import torch
    import torch.nn.functional as F

    nll_base = nll_compressed = kl_sum = 0.0
    agree = positions = 0
    with torch.inference_mode():
        for ids in input_ids:
            # One sample per forward: no padding, so every position is real text.
            tokens = torch.tensor([ids], device=base.device)
            mask = torch.ones_like(tokens)
            logp = F.log_softmax(base(tokens, attention_mask=mask).logits[0, :-1].float(), dim=-1)
            logits_q = compressed(
                tokens.to(compressed.device), attention_mask=mask.to(compressed.device)
            ).logits
            logq = F.log_softmax(logits_q[0, :-1].float().to(logp.device), dim=-1)
            targets = tokens[0, 1:].to(logp.device)
            nll_base -= logp.gather(1, targets[:, None]).sum().item()
            nll_compressed -= logq.gather(1, targets[:, None]).sum().item()
            kl_sum += F.kl_div(logq, logp, log_target=True, reduction="sum").item()
            agree += (logp.argmax(-1) == logq.argmax(-1)).sum().item()
            positions += len(targets)
    base_ppl, compressed_ppl = math.exp(nll_base / positions), math.exp(nll_compressed / positions)
    return QualityMetrics(
        samples=len(input_ids),
        tokens=positions,
        base_perplexity=base_ppl,
        compressed_perplexity=compressed_ppl,
        perplexity_increase_pct=100.0 * (compressed_ppl / base_ppl - 1.0),
        kl_divergence=max(kl_sum / positions, 0.0),  # float rounding can dip below zero
        top1_agreement=agree / positions,
    )


@task(name="compare models", cache_policy=NO_CACHE)
def compare_models(
    base: FetchedModel, compressed_path: str, held_out: HeldOutText
) -> QualityMetrics:
    """Load both models (both must fit the visible devices) and score them on `held_out`."""
    base_model = load_causal_lm(base.path, base.model_class, base.trust_remote_code)
    compressed = load_causal_lm(compressed_path, base.model_class, base.trust_remote_code)
    metrics = score(base_model, compressed, held_out.input_ids)
    get_run_logger().info(
        "Perplexity %.3f -> %.3f (%+.2f%%), KL %.5f nats/token, top-1 agreement %.1f%% over "
        "%d tokens",
        metrics.base_perplexity, metrics.compressed_perplexity, metrics.perplexity_increase_pct,
        metrics.kl_divergence, 100 * metrics.top1_agreement, metrics.tokens,
    )  # fmt: skip
    return metrics


@task(name="lm-eval", cache_policy=NO_CACHE)
def run_lm_eval(
    path: str, tasks: list[str], limit: int | None, trust_remote_code: bool
) -> dict[str, float]:
    """lm-eval-harness `tasks` on the model at `path`: {'<task>/<metric>': value}."""
    import lm_eval

    results = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": path, "trust_remote_code": trust_remote_code},
        tasks=tasks,
        limit=limit,
    )
    return {
        f"{name}/{metric}": float(value)
        for name, values in results["results"].items()
        for metric, value in values.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def breaches(
    metrics: QualityMetrics, max_perplexity_increase_pct: float | None, max_kl: float | None
) -> list[str]:
    """One line per threshold the metrics pass; empty when the model is within bounds."""
    found = []
    if max_perplexity_increase_pct is not None and (
        metrics.perplexity_increase_pct > max_perplexity_increase_pct
        or not math.isfinite(metrics.compressed_perplexity)
    ):
        found.append(
            f"perplexity rose {metrics.perplexity_increase_pct:.2f}% "
            f"(limit {max_perplexity_increase_pct}%)"
        )
    if max_kl is not None and not metrics.kl_divergence <= max_kl:  # NaN counts as a breach
        found.append(f"KL divergence {metrics.kl_divergence:.5f} nats/token (limit {max_kl})")
    return found
