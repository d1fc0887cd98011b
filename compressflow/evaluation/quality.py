"""How far a compressed model's outputs moved from its base model's, on the same token ids.

Per next-token position we take the base model's distribution P and the compressed model's Q:

- perplexity of each (exp of the mean negative log-likelihood of the actual next token);
- KL(P || Q), averaged over positions: how far the whole distribution moved, which catches
  damage that perplexity averages away;
- top-1 agreement: how often both models rank the same next token first.

The evaluate-model flow scores held-out text with these; the thresholds that gate a model live
with the flows' parameters.
"""

from __future__ import annotations

import gc
import math
from pathlib import Path

from compressflow.compat import patch_reloads
from compressflow.errors import first_line
from compressflow.logs import run_logger
from compressflow.model.loading import load_complete
from compressflow.results import FetchedModel, HeldOutText, QualityMetrics


def load_causal_lm(
    path: str,
    model_class: str,
    trust_remote_code: bool,
    what: str = "the model",
    field: str = "model.model_id",
):
    """A model for inference: spread over the visible GPUs when there are any, else CPU; refused
    when it loads incompletely (`what` and `field` name it in the error)."""
    import torch
    import transformers

    patch_reloads()  # compressed checkpoints the pinned transformers cannot otherwise reload
    model = load_complete(
        getattr(transformers, model_class),
        path,
        what,
        field=field,
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
            logp = next_token_logprobs(base, tokens)
            logq = next_token_logprobs(compressed, tokens).to(logp.device)
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


def breaches(
    metrics: QualityMetrics, max_perplexity_increase_pct: float, max_kl: float
) -> list[str]:
    """One line per threshold the metrics pass; empty when the model is within bounds."""
    found = []
    if max_perplexity_increase_pct and (
        metrics.perplexity_increase_pct > max_perplexity_increase_pct
        or not math.isfinite(metrics.compressed_perplexity)
    ):
        found.append(
            f"perplexity rose {metrics.perplexity_increase_pct:.2f}% "
            f"(limit {max_perplexity_increase_pct}%)"
        )
    kl = metrics.kl_divergence  # None: the engine (vLLM) does not measure it
    if max_kl and kl is not None and not kl <= max_kl:  # NaN counts as a breach
        found.append(f"KL divergence {metrics.kl_divergence:.5f} nats/token (limit {max_kl})")
    return found


def compare_logits(
    reference: list, compressed: list, input_ids: list[list[int]] | None = None
) -> dict[str, float]:
    """Mean cosine, mean KL(reference || compressed) and top-1 agreement over all positions;
    with the samples' `input_ids`, both models' perplexity on them too.

    Each list holds one [positions, vocab] tensor per sample. Non-finite logits give NaN
    figures, which no threshold accepts.
    """
    import torch
    import torch.nn.functional as F

    cosine = kl = agree = nll_reference = nll_compressed = 0.0
    positions = predicted = 0
    for number, (ref, new) in enumerate(zip(reference, compressed, strict=True)):
        ref, new = ref.float(), new.float().to(ref.device)
        if not torch.isfinite(new).all():
            return {"cosine": math.nan, "kl_divergence": math.nan, "top1_agreement": math.nan}
        cosine += F.cosine_similarity(ref, new, dim=-1).sum().item()
        logp, logq = F.log_softmax(ref, dim=-1), F.log_softmax(new, dim=-1)
        kl += F.kl_div(logq, logp, log_target=True, reduction="sum").item()
        agree += (ref.argmax(-1) == new.argmax(-1)).sum().item()
        positions += ref.shape[0]
        if input_ids is not None:  # position i predicts token i + 1
            following = torch.tensor(input_ids[number][1 : ref.shape[0]])[:, None]
            nll_reference -= logp[: len(following)].gather(-1, following).sum().item()
            nll_compressed -= logq[: len(following)].gather(-1, following).sum().item()
            predicted += len(following)
    figures = {
        "cosine": cosine / positions,
        "kl_divergence": max(kl / positions, 0.0),  # float rounding can dip below zero
        "top1_agreement": agree / positions,
    }
    if predicted:
        figures["base_perplexity"] = math.exp(nll_reference / predicted)
        figures["compressed_perplexity"] = math.exp(nll_compressed / predicted)
    return figures


# Tokens (samples x the longest sample) one forward of `logits_of` holds. VerifyArgs' default
# 4 x 64 and up to 16 x 256 go in one forward, so a model whose weights are read from disk reads
# each weight once; longer texts split into forwards that keep the activations, the attention
# mask and the logits of one forward bounded (16 x 2048 tokens take 8).
TOKENS_PER_FORWARD = 4096


def logits_of(model, samples: list[list[int]], tokens_per_forward: int = TOKENS_PER_FORWARD):
    """The model's next-token logits for each sample: one float32 [length, vocab] CPU tensor each.

    The samples go through together, right-padded under an attention mask, so an offloaded model
    reads each weight once per forward instead of once per sample; a real token sees only the
    tokens before it, so padding after it leaves its logits as a forward of its own gives them
    (equal within float rounding).
    """
    import torch
    from compressed_tensors.offload import disable_onloading

    with disable_onloading():  # an offloaded weight is a meta tensor here, not read from disk
        device = next(model.parameters()).device
    if device.type == "meta":  # offloaded: its modules move their inputs where they compute
        device = torch.device("cpu")
    logits = []
    with torch.inference_mode():
        for group in forwards(samples, tokens_per_forward):
            ids = torch.zeros(len(group), max(map(len, group)), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, sample in enumerate(group):
                ids[row, : len(sample)] = torch.tensor(sample)
                mask[row, : len(sample)] = 1
            out = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
            # Cloned: a view would keep (and torch.save would write) the whole padded batch.
            logits += [
                out[row, : len(sample)].float().cpu().clone() for row, sample in enumerate(group)
            ]
    return logits


def logits_streamed(model, samples: list[list[int]], forward=None):
    """`logits_of` a streamed model (compressflow/model/streaming.py), or `forward(model,
    samples)`; None, with a warning that says why, when there is none or its forward failed:
    streaming only saves reads, so the caller loads the model with transformers and computes the
    same logits the proven way. (A model whose code reads another module's weights outside that
    module's call meets them on the meta device; a failure streaming does not foresee must not
    fail a run that loading would pass.)"""
    if model is None:
        return None
    try:
        return (forward or logits_of)(model, samples)
    except Exception as exc:  # noqa: BLE001 - any failure: the loaded model's pass follows
        run_logger(__name__).warning(
            "Streaming the model's weights failed (%s); loading it instead, which reads "
            "its weights once more",
            first_line(exc),
        )
        return None


def save_reference(path: Path, input_ids: list[list[int]], logits: list) -> None:
    """The base model's logits on the verification texts, with their token ids, as safetensors:
    a full disk raises with its OS error there (torch.save's zip writer loses it), so the caller
    can say the disk is full."""
    import torch
    from safetensors.torch import save_file

    tensors = {}
    for i, (ids, rows) in enumerate(zip(input_ids, logits, strict=True)):
        tensors[f"input_ids.{i}"] = torch.tensor(ids, dtype=torch.int64)
        tensors[f"logits.{i}"] = rows.contiguous()
    save_file(tensors, str(path), metadata={"samples": str(len(input_ids))})


def read_reference(path: Path) -> dict:
    """What `save_reference` wrote: {"input_ids": [[int]], "logits": [tensor]}."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as saved:
        count = int(saved.metadata()["samples"])
        return {
            "input_ids": [saved.get_tensor(f"input_ids.{i}").tolist() for i in range(count)],
            "logits": [saved.get_tensor(f"logits.{i}") for i in range(count)],
        }


def forwards(samples: list[list[int]], tokens_per_forward: int) -> list[list[list[int]]]:
    """`samples` in order, split into groups of at most `tokens_per_forward` padded tokens (a
    sample longer than that goes alone)."""
    groups: list[list[list[int]]] = []
    longest = 0
    for sample in samples:
        longest = max(longest, len(sample))
        if groups and (len(groups[-1]) + 1) * longest <= tokens_per_forward:
            groups[-1].append(sample)
        else:
            groups.append([sample])
            longest = len(sample)
    return groups


def next_token_logprobs(model, tokens):
    """Log-probabilities of the next token at every position but the last, for one unpadded
    sample (`tokens`: [1, length]); float32 on the model's device."""
    import torch
    import torch.nn.functional as F

    tokens = tokens.to(model.device)
    logits = model(tokens, attention_mask=torch.ones_like(tokens)).logits
    return F.log_softmax(logits[0, :-1].float(), dim=-1)


def perplexity(model, input_ids: list[list[int]]) -> float:
    """One model's perplexity over every next-token position, scored as `score` scores each model
    (one sample per forward, no padding): for a model measured once and compared many times."""
    import torch

    nll, positions = 0.0, 0
    with torch.inference_mode():
        for ids in input_ids:
            tokens = torch.tensor([ids], device=model.device)
            logp = next_token_logprobs(model, tokens)
            nll -= logp.gather(1, tokens[0, 1:, None]).sum().item()
            positions += len(ids) - 1
    return math.exp(nll / positions)


def perplexity_of(path: str, model: FetchedModel, held_out: HeldOutText) -> float:
    source = path == model.path
    loaded = load_causal_lm(
        path,
        model.model_class,
        model.trust_remote_code,
        "the source model" if source else "a compressed candidate",
        "model.model_id" if source else "recipe",
    )
    try:
        return perplexity(loaded, held_out.input_ids)
    finally:
        del loaded
        gc.collect()


def score_with_transformers(
    base: FetchedModel, compressed_path: str, held_out: HeldOutText
) -> QualityMetrics:
    """Both models loaded with transformers and scored on `held_out` (the compare stage's child)."""
    base_model = load_causal_lm(
        base.path, base.model_class, base.trust_remote_code, "the base model", "base.model_id"
    )
    compressed = load_causal_lm(
        compressed_path,
        base.model_class,
        base.trust_remote_code,
        "the compressed model",
        "compressed.model_id",
    )
    return score(base_model, compressed, held_out.input_ids)
