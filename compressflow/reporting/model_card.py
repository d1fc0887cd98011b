"""The model card: `README.md` in every published folder, as a Hugging Face model page shows it.

Its YAML front matter (written by huggingface_hub's ModelCardData, not by hand) carries what the
hub indexes: the base model, the library, the tags (the scheme, `compressed-tensors`) and the
license carried from the source's own card. The body says what was done, how the output was
proven (verification, and vLLM's score where a vLLM environment served it), sizes, the command
that serves it and where it came from. Everything is read from the manifest, so the card and
`manifest.json` cannot disagree. evaluate-model adds its results as a section of their own
(`add_evaluation`), replaced by the next evaluation.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from urllib.parse import unquote

from compressflow.limits import MAX_TEXT_BYTES
from compressflow.registries.presets import KV_CACHE_FP8
from compressflow.reporting.artifacts import display_name, location_markdown, logit_figures
from compressflow.reporting.performance import performance_markdown
from compressflow.reporting.tradeoff import SVG_FILE, tradeoff_markdown
from compressflow.results import (
    EvaluationReport,
    MemoryPlan,
    ServingCheck,
    TargetSearch,
    Verification,
)
from compressflow.store.manifest import CARD, Manifest, read_manifest


def source_license(source: Path) -> str | None:
    """The license in the source's own card; None when it has none we can read.

    The source's card is input nobody here wrote: a large or malformed one is ignored, never
    fatal (the output is already verified; a missing license line is not a reason to refuse it).
    """
    import yaml
    from huggingface_hub import ModelCard

    card = source / CARD
    if not card.is_file() or card.stat().st_size > MAX_TEXT_BYTES:
        return None
    try:
        license = ModelCard.load(card).data.license
    except (ValueError, OSError, yaml.YAMLError):  # front matter that is not a mapping, or not YAML
        return None
    return license if isinstance(license, str) else None


def vllm_line(served: ServingCheck | None) -> str:
    if served is None:
        return "not run"
    if served.outcome != "served":
        return f"{served.outcome}: {served.reason}"
    m = served.metrics
    return (
        f"served by vLLM {served.vllm_version}; perplexity {m.base_perplexity:.4g} (base) -> "
        f"{m.compressed_perplexity:.4g}, recovery {100 * m.base_perplexity / m.compressed_perplexity:.1f}%"
        f", top-1 agreement {m.top1_agreement:.1%} over {m.tokens} held-out tokens"
    )


def kv_cache_line(scheme: dict | None, served: ServingCheck | None) -> str:
    """What the KV cache holds, how to serve it, and whether vLLM here served it that way; ""
    when keys and values stay in the model's dtype."""
    if not scheme:
        return ""
    if scheme == KV_CACHE_FP8:
        what = (
            "FP8 (E4M3) with calibrated per-tensor scales, one for keys and one for values in "
            "each attention layer"
        )
    else:
        kind = "dynamic" if scheme["dynamic"] else "calibrated"
        what = f"{scheme['num_bits']}-bit {scheme['type']} with {kind} {scheme['strategy']} scales"
    if served is None:
        here = "vLLM did not run here"
    elif served.outcome != "served":
        here = f"not served here ({served.outcome}: see vLLM above)"
    else:
        dtype = served.kv_cache_dtype or "auto"
        here = f"served here by vLLM {served.vllm_version} with `kv_cache_dtype={dtype}`"
    return f"- **KV cache**: {what}; serve it with `--kv-cache-dtype fp8`; {here}\n"


def verification_list(verification: Verification | None) -> str:
    """One line per check, a failure in bold: a list, not a table, because a table does not
    wrap a long detail in Prefect's artifact view (the logits and vLLM lines were cut off)."""
    if verification is None:
        return "Not verified.\n"
    lines = []
    for check in verification.checks:
        verdict = check.verdict()
        verdict = f"**{verdict}**" if verdict == "FAIL" else verdict
        detail = " ".join(check.detail.split())  # a library's message may hold newlines
        lines.append(f"- **{check.name}**: {verdict}: {detail}")
    return "\n".join(lines) + "\n"


def calibration_lines(manifest: Manifest) -> str:
    dataset, given = manifest.dataset, manifest.inputs.get("dataset", {})
    if not dataset:
        return "- **Calibration data**: none (the recipe needs none)\n"
    stats = dataset["token_stats"]
    return (
        f"- **Calibration data**: {dataset['num_samples']} samples from `{dataset['source']}`, "
        f"at most {given.get('max_seq_len')} tokens each ({stats['total']:.0f} tokens), "
        f"sampled with seed {given.get('seed')}\n"
    )


def memory_line(plan: MemoryPlan | None) -> str:
    """Where calibration kept the weights, and on a GPU what its batch cost over batch 1."""
    if plan is None:
        return ""
    free = plan.path == "model_free"
    where = "no model built" if free else f"weights on {plan.placement}"
    cost = plan.gpu_cost() or ("" if free else f"batch {plan.batch_size}")
    return (
        f"- **Calibration memory**: {plan.path} path, {where}, computed on {plan.device}"
        + (f"; {cost}" if cost else "")
        + "\n"
    )


def verified(verification: Verification | None) -> str:
    if verification is None:
        return "no"
    figures = logit_figures(verification)
    return f"{'yes' if verification.passed else 'NO'}: {len(verification.checks)} checks" + (
        f" ({figures})" if figures else ""
    )


def base_model_line(model: dict) -> str:
    """The id or folder the user gave, then where it resolved to: what the hash identity hides."""
    resolved = model.get("revision_resolved")
    detail = f"revision `{resolved}`" if resolved else f"`{model['identity']}`"
    return f"`{model['model_id']}` ({model['source']}, {detail})"


def mix_section(search: TargetSearch, inline_chart: bool) -> str:
    """What a mixed-precision budget asked, chose and measured, and the trade-off chart (inline
    in the run's summary; the card links `tradeoff.svg` beside it)."""
    mix, chosen = search.mix, search.chosen()
    asked = " and ".join(
        text
        for text in (
            f"at most {search.avg_bits:g} bits per weight" if search.avg_bits else "",
            f"held-out perplexity at most {search.max_perplexity_ratio}x the base model's"
            if search.max_perplexity_ratio
            else "",
        )
        if text
    )
    counts: dict[str, int] = {}
    for precision in mix.precisions.values():
        counts[precision] = counts.get(precision, 0) + 1
    chosen_text = ", ".join(f"{n} module(s) {p}" for p, n in counts.items())
    rounds = "\n".join(
        f"| {r.round} | {r.avg_bits:.3f} | {r.predicted_ratio:.4f} | {r.ratio:.4f} | "
        f"{r.size_bytes / 1e6:.2f} |" + (" published |" if r.round == chosen.round else " |")
        for r in search.rounds
    )
    gpu = (
        "\n\nFP4 needs a GPU to serve (Blackwell, or weight-only FP4 Marlin on Ampere and "
        "later): the figures here are compressed-tensors' arithmetic on this host; served on a "
        "GPU they may differ slightly."
        if mix.family == "float"
        else ""
    )
    return (
        f"## Mixed precision\n\nAsked for {asked}. Each module's sensitivity was measured "
        f"once ({mix.sensitivity_seconds:.0f} s, one pass over {search.held_out_samples} "
        f"held-out texts from `{search.held_out_source}`, none of them calibration data) and a "
        f"precision chosen per module: {chosen_text}, {mix.avg_bits:.3f} bits per weight. "
        f"Held-out perplexity {chosen.perplexity:.4g}, ratio {chosen.ratio:.4f} to the base "
        f"model's {search.base_perplexity:.4g}.{gpu}\n\n"
        "| round | bits per weight | predicted ratio | measured ratio | size (MB) | |\n"
        f"|---|---|---|---|---|---|\n{rounds}\n\n"
        + tradeoff_markdown(search, mix.points, image="" if inline_chart else SVG_FILE)
        + "\n"
    )


def target_section(search: TargetSearch | None, inline_chart: bool = False) -> str:
    """What compressing to a quality target kept unquantized, what it cost, and every round."""
    chosen = search.chosen() if search else None
    if chosen is None:  # no target, or none met (then nothing is published)
        return ""
    if search.mix is not None:
        return mix_section(search, inline_chart)
    first, cost = search.rounds[0], search.size_cost_bytes()
    measured = (
        f"Target: held-out perplexity at most {search.max_perplexity_ratio}x the base model's "
        f"({search.base_perplexity:.4g} on {search.held_out_samples} texts from "
        f"`{search.held_out_source}`, none of them calibration data). "
    )
    if not chosen.unquantized:
        kept = (
            f"The recipe as asked met it (ratio {chosen.ratio:.4f}): no module is kept "
            "unquantized and there is no size cost.\n\n"
        )
    else:
        names = "\n".join(f"- `{name}`" for name in chosen.unquantized)
        kept = (
            f"Met in round {chosen.round} of {len(search.rounds)} (ratio {chosen.ratio:.4f}; "
            f"the recipe as asked: {first.ratio:.4f}) with {len(chosen.unquantized)} of "
            f"{search.ranked_modules} module(s) kept unquantized, those with the largest GPTQ "
            f"error:\n\n{names}\n\n"
            f"**Size cost**: {cost / 1e6:+.2f} MB ({100 * cost / max(first.size_bytes, 1):+.1f}%)"
            f" against the recipe as asked ({first.size_bytes / 1e6:.2f} MB).\n\n"
        )
    rows = "\n".join(
        f"| {r.round} | {len(r.unquantized)} | {r.perplexity:.4g} | {r.ratio:.4f} | "
        f"{'met' if r.met else 'missed'} | {r.size_bytes / 1e6:.2f} |"
        + (" published |" if r.round == chosen.round else " |")
        for r in search.rounds
    )
    return (
        f"## Compressed to a target\n\n{measured}{kept}"
        "| round | modules unquantized | perplexity | ratio | target | size (MB) | |\n"
        f"|---|---|---|---|---|---|---|\n{rows}\n\n"
    )


def serve_command(folder: Path | str, upload_uri: str = "", kv_cache: bool = False) -> str:
    """The `vllm serve` line: from the store where the model was uploaded (vLLM streams s3://
    with its Run:ai loader; a file:// upload is a folder), else from the published folder."""
    if upload_uri.startswith("s3://"):
        where, flags = upload_uri, " --load-format runai_streamer"
    elif upload_uri.startswith("file://"):
        where, flags = unquote(upload_uri.removeprefix("file://")), ""
    else:
        where, flags = str(folder), ""
    return f"vllm serve {shlex.quote(where)}{flags}" + (" --kv-cache-dtype fp8" if kv_cache else "")


def card_body(
    manifest: Manifest,
    folder: Path | str,
    run_link: str | None,
    show_output: bool = False,
    upload_uri: str = "",
) -> str:
    """The card without its front matter: also the body of the run's Prefect summary, which
    names the output folder (`show_output`); the card lives in that folder. `upload_uri`: where
    the model is uploaded (output.upload_uri), which the serve line then loads from."""
    model, result = manifest.model, manifest.result
    served = manifest.verification.vllm if manifest.verification else None
    kv_cache = manifest.recipe.get("kv_cache_scheme")
    libraries = ", ".join(f"{name} {version}" for name, version in manifest.libraries.items())
    modifiers = ", ".join(manifest.recipe.get("modifiers", []))
    run = f"- **ClearML**: {location_markdown(run_link, 'task page')}\n" if run_link else ""
    return (
        f"# Compressed model: {display_name(model['model_id'], manifest.recipe['source'])}\n\n"
        + (f"- **Output**: `{folder}`\n" if show_output else "")
        + (f"- **Uploaded to**: `{upload_uri}`\n" if upload_uri else "")
        + f"- **Base model**: {base_model_line(model)}\n"
        f"- **Recipe**: `{manifest.recipe['source']}`"
        + (f" ({modifiers})" if modifiers else "")
        + f", scheme {result.scheme or 'none'}; `recipe.yaml` beside the weights\n"
        f"{calibration_lines(manifest)}"
        f"{memory_line(manifest.memory_plan)}"
        f"- **Size**: {result.size_bytes / 1e6:.1f} MB (original "
        f"{result.original_size_bytes / 1e6:.1f} MB, ratio {result.compression_ratio:.2f}x)\n"
        f"- **Verified**: {verified(manifest.verification)}\n"
        f"- **vLLM**: {vllm_line(served)}\n"
        f"{kv_cache_line(kv_cache, served)}"
        f"{run}"
        f"- **Run key**: `{result.run_key}`, published {manifest.created_at}\n\n"
        f"{target_section(manifest.target, show_output)}"
        f"## Verification\n\n{verification_list(manifest.verification)}\n"
        "## Serve it\n\n"
        f"```bash\n{serve_command(folder, upload_uri, bool(kv_cache))}\n```\n\n"
        f"Made with {libraries or 'compressflow'}; `manifest.json` holds every figure above and "
        "the run's parameters.\n"
    )


def model_card(
    manifest: Manifest, folder: Path, source: Path, run_link: str | None, upload_uri: str = ""
) -> str:
    """The card's full text for the published `folder`, made from `source` (and uploaded to
    `upload_uri`, when set)."""
    from huggingface_hub import ModelCard, ModelCardData

    result = manifest.result
    hub_base = manifest.model["model_id"] if manifest.model["source"] == "hub" else None
    data = ModelCardData(
        base_model=hub_base,
        base_model_relation="quantized" if hub_base and result.scheme else None,
        library_name="transformers",
        license=source_license(source),
        pipeline_tag="text-generation",
        tags=[
            t for t in ("compressed-tensors", "llm-compressor", "compressflow", result.scheme) if t
        ],
    )
    body = card_body(manifest, folder, run_link, upload_uri=upload_uri)
    # Not a template: names in the body (a model id, a path) are text, never template code.
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}"))


# The evaluation section's bounds: a later evaluation replaces the earlier one's section.
EVALUATION_START = "<!-- compressflow: evaluation -->"
EVALUATION_END = "<!-- compressflow: end of evaluation -->"


def evaluation_section(report: EvaluationReport, base_id: str, engine: str) -> str:
    m = report.metrics
    kl = "not measured (vLLM)" if m.kl_divergence is None else f"{m.kl_divergence:.4g} nats/token"
    rows = [
        f"| perplexity | {m.base_perplexity:.4g} | {m.compressed_perplexity:.4g} | "
        f"{100 * m.base_perplexity / m.compressed_perplexity:.1f}% |",
        f"| top-1 agreement | 100% | {m.top1_agreement:.1%} | |",
        f"| KL(base \\|\\| compressed) | 0 | {kl} | |",
    ]
    base = report.lm_eval.get("base", {})
    for name, value in report.lm_eval.get("compressed", {}).items():
        recovered = report.lm_eval_recovery.get(name)
        rows.append(
            f"| lm-eval {name} ({report.lm_eval_backend}) | {base.get(name, 0):.4g} | "
            f"{value:.4g} | {'' if recovered is None else f'{recovered:.1f}%'} |"
        )
    verdict = "within the gate" if report.passed else "OVER THE GATE: " + "; ".join(report.breaches)
    if report.flags:  # what the gate could not judge: warnings, not failures
        verdict += " (flagged: " + "; ".join(report.flags) + ")"
    performance = "" if report.served is None else "\n" + performance_markdown(report.served)
    return (
        f"{EVALUATION_START}\n## Evaluation\n\n"
        f"Against `{base_id}` on {m.samples} held-out texts ({m.tokens} tokens, "
        f"{report.excluded_calibration_samples} calibration texts left out) from "
        f"`{report.held_out_source}`, scored by {engine}: {verdict}.\n\n"
        "| metric | base | compressed | recovery |\n|---|---|---|---|\n"
        + "\n".join(rows)
        + f"\n{performance}{EVALUATION_END}\n"
    )


def with_evaluation(card: str, section: str) -> str:
    """`card` with `section` in place of an earlier evaluation's, or appended."""
    start, end = card.find(EVALUATION_START), card.find(EVALUATION_END)
    if start >= 0 and end > start:
        return card[:start] + section + card[end + len(EVALUATION_END) + 1 :]
    return card.rstrip("\n") + "\n\n" + section


def with_verification(card: str, manifest: Manifest) -> str:
    """`card` with its verdict, vLLM line and verification list made anew from `manifest`
    (after vLLM checked a reused output); the rest, an evaluation's section included, is kept."""
    lines = card.splitlines(keepends=True)
    served = manifest.verification.vllm if manifest.verification else None
    fresh = {
        "- **Verified**: ": f"- **Verified**: {verified(manifest.verification)}\n",
        "- **vLLM**: ": f"- **vLLM**: {vllm_line(served)}\n",
        "- **KV cache**: ": kv_cache_line(manifest.recipe.get("kv_cache_scheme"), served),
    }
    lines = [next((v for k, v in fresh.items() if line.startswith(k)), line) for line in lines]
    text = "".join(lines)
    start, end = text.find("## Verification\n\n"), text.find("\n## Serve it")
    if 0 <= start < end:
        listing = verification_list(manifest.verification)
        text = f"{text[:start]}## Verification\n\n{listing}{text[end:]}"
    return text


def add_evaluation(folder: Path, section: str) -> bool:
    """Write `section` into the card of a folder compressflow published; False when the folder
    is not one (no manifest, or no card of ours): a model we did not publish is never written."""
    return edit_card(folder, lambda card: with_evaluation(card, section))


def edit_card(folder: Path, edit) -> bool:
    """Replace the card of a folder compressflow published with `edit(card)`, atomically; False
    when the folder is not one: a model we did not publish is never written."""
    card = folder / CARD
    if read_manifest(folder) is None or card.is_symlink() or not card.is_file():
        return False
    text = card.read_text(encoding="utf-8")
    if "compressflow" not in text:
        return False
    staged = folder / f".{CARD}.{os.getpid()}.tmp"
    try:
        staged.write_text(edit(text), encoding="utf-8")
        os.replace(staged, card)  # atomic: a reader sees the old card or the new one
    finally:
        staged.unlink(missing_ok=True)  # gone after the rename; a half-written copy otherwise
    return True
