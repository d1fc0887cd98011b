"""How each stage's result reads in the run's ClearML task: its parameters, scalars, tables.

The result types (each slice's `result.py`) hold what a stage found; what a person sees of it in
ClearML is written here, one function per type behind `log_to`, so a result module carries no
display code. `tracking.log_result` calls it with the process's tracker.
"""

from __future__ import annotations

from functools import singledispatch

from compressflow.data.result import BuiltDataset
from compressflow.model.result import FetchedModel, MemoryPlan
from compressflow.recipes.result import RenderedRecipe, TargetSearch
from compressflow.verification.result import Verification


@singledispatch
def log_to(result, tracker) -> None:
    """Log `result` into `tracker`; a type with nothing to show logs nothing."""


@log_to.register
def _(model: FetchedModel, tracker) -> None:
    tracker.params(
        "model",
        {
            "model_id": model.model_id,
            "source": model.source,
            "revision_requested": model.revision_requested or "",
            "revision_resolved": model.revision_resolved or "",
            "identity": model.identity,
            "size_bytes": model.size_bytes,
            "parameters": model.parameters or 0,
            "model_class": model.model_class,
        },
    )


@log_to.register
def _(plan: MemoryPlan, tracker) -> None:
    tracker.params("memory plan", plan.model_dump(exclude={"notes"}))


@log_to.register
def _(dataset: BuiltDataset, tracker) -> None:
    tracker.params(
        "dataset",
        {
            "source": dataset.source,
            "fingerprint": dataset.fingerprint,
            "samples": dataset.num_samples,
            "chat_template_applied": dataset.chat_template_applied,
            **{f"tokens_{name}": value for name, value in dataset.token_stats.items()},
        },
    )


@log_to.register
def _(recipe: RenderedRecipe, tracker) -> None:
    tracker.configuration("recipe", recipe.yaml, description=f"Rendered from {recipe.source}")
    tracker.params("recipe_args", recipe.args)
    if recipe.notes:
        tracker.params("recipe_notes", dict(enumerate(recipe.notes)))


@log_to.register
def _(search: TargetSearch, tracker) -> None:
    for r in search.rounds:
        tracker.scalar("target perplexity ratio", "round", r.ratio, r.round)
        tracker.scalar("target modules unquantized", "round", len(r.unquantized), r.round)
    tracker.table(
        "compress to target",
        [
            {
                "round": r.round,
                "unquantized": len(r.unquantized),
                "avg_bits": r.avg_bits,
                "ratio": round(r.ratio, 5),
                "target": search.max_perplexity_ratio,
                "met": r.met,
                "size_bytes": r.size_bytes,
                "chosen": r.round == search.chosen_round,
            }
            for r in search.rounds
        ],
    )
    if search.mix is not None:
        for measured, series in ((False, "predicted"), (True, "measured")):
            tracker.scatter(
                "size vs held-out perplexity",
                series,
                [[p.avg_bits, p.perplexity] for p in search.mix.points if p.measured == measured],
                ("bits per weight", "held-out perplexity"),
            )
        tracker.table(
            "precision per module",
            [{"module": name, "precision": p} for name, p in search.mix.precisions.items()],
        )
    chosen = search.chosen()
    if chosen is not None:
        tracker.params(
            "target",
            {
                "max_perplexity_ratio": search.max_perplexity_ratio,
                "chosen_round": chosen.round,
                "ratio": chosen.ratio,
                "size_cost_bytes": search.size_cost_bytes(),
                "unquantized": ", ".join(chosen.unquantized) or "none",
            },
        )


@log_to.register
def _(verification: Verification, tracker) -> None:
    tracker.params(
        "verification",
        {
            "passed": verification.passed,
            **{check.name: check.detail for check in verification.checks},
        },
    )
    for name in ("cosine", "kl_divergence", "top1_agreement"):
        if getattr(verification, name) is not None:
            tracker.single(f"verification {name}", getattr(verification, name))
