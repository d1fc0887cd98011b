"""Compress to a target, end to end: the compress-model flow on the learned-weights yardstick
(tests/conftest.py's `yardstick`): a target plain W4A16 misses is met by leaving the worst
modules unquantized, and one that cannot be met publishes nothing.

The search's parts, without a flow: tests/unit/test_compress_to_target.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support.recipes import quantizing_modifiers

from compressflow.errors import TargetNotMet
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

# end to end, on the learned-weights yardstick

HELD_OUT_TEXTS = 128
BEST = re.compile(
    r"the best, round (\d+) with (\d+) of (\d+) modules unquantized, reached (\d+\.\d+) "
    r"\(the recipe as asked: (\d+\.\d+)\)"
)


def test_the_smallest_mix_that_meets_a_target_is_published_and_an_unmeetable_one_is_refused(
    yardstick, test_root, prefect_harness
):
    """On the yardstick (W4A16, 256 calibration texts, 128 held-out texts). Which mix helps
    depends on where GPTQ's rounding lands, so on the CPU that trained the yardstick. On an
    Intel Xeon the recipe as asked reached a perplexity ratio of 1.0145, and 1, 2 and 4 modules
    unquantized 1.0123, 1.0122 and 1.0117. On an AMD EPYC (AVX2) it reached 1.0131, and the mixes
    1.0138, 1.0137 and 1.0136. The refusal's four rounds find the best mix on this machine. When
    one beats the recipe, the target lies between the two (the plain recipe misses it, a mix
    meets it); otherwise it is the plain recipe's ratio, met in round 1."""
    from compressflow.flows.compress import compress
    from compressflow.store.manifest import read_manifest

    root = test_root / "target"

    def run(name: str, ratio: float, rounds: int):
        return compress(
            model=ModelArgs(model_id=str(yardstick.model)),
            dataset=DatasetArgs(
                dataset_name=str(yardstick.calibration),
                text_samples=256,
                max_seq_len=yardstick.spec.seq_len,
            ),
            recipe=RecipeArgs(preset="W4A16"),
            output=OutputArgs(save_directory=str(root / name), auto_evaluate=False),
            tracking=TrackingArgs(enabled=False),
            verify=VerifyArgs(vllm="off"),
            target=TargetArgs(
                max_perplexity_ratio=ratio,
                max_rounds=rounds,
                method="leave_unquantized",  # mixed precision: test_mixed_precision_yardstick.py
                held_out=HeldOutArgs(
                    dataset_name=str(yardstick.held_out),
                    samples=HELD_OUT_TEXTS,
                    max_seq_len=yardstick.spec.seq_len,
                ),
            ),
        )

    # A target no configuration meets in four rounds: refused, nothing published or left behind.
    with pytest.raises(TargetNotMet) as raised:
        run("unmeetable", 1.0001, 4)
    error = raised.value
    assert error.field == "target.max_perplexity_ratio"
    assert "in 4 round(s)" in error.problem
    assert "raise target.max_rounds" in error.fix and "more bits" in error.fix
    assert not (root / "unmeetable").exists() and not list(root.glob(".unmeetable.*"))
    found = BEST.search(error.problem)
    assert found, error.problem
    _, best_modules, total, best, plain = found.groups()
    print(f"W4A16 perplexity ratio: as asked {plain}, best mix ({best_modules} modules) {best}")
    assert 1.0 < float(best) <= float(plain)
    searched = float(best) < float(plain)
    if searched:  # between the two: the recipe as asked misses it, a mix meets it
        target = round((float(plain) + float(best)) / 2, 5)
    else:  # no mix of up to 4 modules beat the recipe here (the AMD row above): it meets this
        target = float(plain) + 0.0001  # the message rounds to 4 places

    published = run("met", target, 4)
    folder = Path(published.path)
    manifest = read_manifest(folder)
    search = manifest.target
    for r in search.rounds:
        print(
            f"round {r.round}: {len(r.unquantized)} unquantized, ratio {r.ratio:.4f}, {r.size_bytes} B"
        )
    chosen = search.chosen()
    assert chosen.met and chosen.ratio <= target
    # The smallest mix that meets it: no round with fewer modules unquantized met it.
    unquantized = chosen.unquantized
    assert all(r.met == (r.ratio <= target) for r in search.rounds)
    assert not [r for r in search.rounds if r.met and len(r.unquantized) < len(unquantized)]
    assert manifest.inputs["target"]["max_perplexity_ratio"] == target
    # What was published is that round: its size, its recipe, its checkpoint.
    assert manifest.result.size_bytes == chosen.size_bytes
    assert not set(unquantized) & {m.name for m in manifest.modules}
    assert len(manifest.modules) == int(total) - len(unquantized)
    gptq = quantizing_modifiers((folder / "recipe.yaml").read_text())["GPTQModifier"]
    assert gptq["ignore"][0] == "lm_head" and sorted(gptq["ignore"][1:]) == sorted(unquantized)
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert set(unquantized) <= set(config["ignore"])
    assert manifest.verification.passed
    card = (folder / "README.md").read_text()
    assert "## Compressed to a target" in card and "published |" in card
    if searched:
        assert not search.rounds[0].met and search.rounds[0].ratio > target
        assert 0 < len(unquantized) <= int(best_modules)
        assert all(m.startswith("model.layers.") and not m.startswith("re:") for m in unquantized)
        assert search.size_cost_bytes() == chosen.size_bytes - search.rounds[0].size_bytes > 0
        assert all(f"- `{m}`" in card for m in unquantized) and "**Size cost**: +" in card
        assert f"| {chosen.round} | {len(unquantized)} |" in card
    else:  # round 1 met it: nothing searched, nothing left unquantized
        assert [r.round for r in search.rounds] == [1] and unquantized == []
        assert search.size_cost_bytes() == 0
    # Round 1's output, and every reference file beside the stagings, is gone.
    assert not list(root.glob(".met.*"))
