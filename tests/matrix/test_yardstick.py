"""The learned-weights yardstick: it builds, it has learned, and on it quantization orders as it
must on learned weights (GPTQ beats round-to-nearest at 4 bits; 8-bit schemes stay near the base).

Each scheme goes through the compress-model flow, calibrated on the yardstick's training split,
and is scored by the evaluate-model flow on its held-out files. The margins come from measured
spread (docs/benchmarks/quality.md, "Seed spread"), not guesses; MEASURED below.
"""

from __future__ import annotations

import json
import math

import pytest

from compressflow.demo.yardstick import YardstickSpec, build_yardstick, corpus_files, perplexity

CALIBRATION_TEXTS = 256
HELD_OUT_TEXTS = 512
# MEASURED (docs/benchmarks/quality.md, "The yardstick now", 3 calibration seeds): round-to-nearest
# W4A16 +2.33% (data-free, one value); GPTQ W4A16 +1.09% to +1.18%, so a gap of 1.15 to 1.24
# points; W8A8 +0.02%; FP8_DYNAMIC +0.24% (data-free). The 1500-step build it replaced: +2.74%,
# +1.22% to +1.41%, W8A8 +0.00% to +0.03% (6 runs with W8A8_GPTQ), FP8_DYNAMIC +0.43%.
RTN_W4A16 = """\
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      targets: Linear
      scheme: W4A16
      ignore: [lm_head]
"""


@pytest.fixture(scope="session")
def increase(yardstick, test_root, prefect_harness):
    """Held-out perplexity increase over the base, in percent, of each scheme (one seed)."""
    from compressflow.flows.compress import compress
    from compressflow.flows.evaluate import evaluate
    from compressflow.params import (
        DatasetArgs,
        HeldOutArgs,
        ModelArgs,
        OutputArgs,
        QualityGate,
        RecipeArgs,
        ServedArgs,
        TrackingArgs,
        VerifyArgs,
    )

    recipes = {
        "RTN_W4A16": RecipeArgs(recipe=RTN_W4A16),
        "W4A16": RecipeArgs(preset="W4A16"),
        "W8A8": RecipeArgs(preset="W8A8"),
        "FP8_DYNAMIC": RecipeArgs(preset="FP8_DYNAMIC"),
    }
    found = {}
    for name, recipe in recipes.items():
        published = compress(
            model=ModelArgs(model_id=str(yardstick.model)),
            dataset=DatasetArgs(
                dataset_name=str(yardstick.calibration),
                text_samples=CALIBRATION_TEXTS,
                max_seq_len=yardstick.spec.seq_len,
            ),
            recipe=recipe,
            output=OutputArgs(
                save_directory=str(test_root / "yardstick-outputs" / name), auto_evaluate=False
            ),
            tracking=TrackingArgs(enabled=False),
            verify=VerifyArgs(vllm="off"),
        )
        report = evaluate(
            compressed=ModelArgs(model_id=published.path),
            held_out=HeldOutArgs(
                dataset_name=str(yardstick.held_out),
                samples=HELD_OUT_TEXTS,
                max_seq_len=yardstick.spec.seq_len,
            ),
            gate=QualityGate(max_perplexity_increase_pct=0, max_kl=0),
            served=ServedArgs(measure=False),  # quality orderings only
            tracking=TrackingArgs(enabled=False),
        )
        found[name] = report.metrics.perplexity_increase_pct
    return found


def test_yardstick_has_learned_and_is_reused(yardstick):
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    texts = yardstick.held_out_texts()[:64]
    tokenizer = AutoTokenizer.from_pretrained(yardstick.model)
    config = LlamaConfig.from_pretrained(yardstick.model)
    torch.manual_seed(0)
    random_ppl = perplexity(LlamaForCausalLM(config).eval(), tokenizer, texts, 128)
    learned = LlamaForCausalLM.from_pretrained(yardstick.model).eval()
    learned_ppl = perplexity(learned, tokenizer, texts, 128)
    # Random weights score about the vocabulary size; the trained model a small fraction of it.
    assert random_ppl > 0.5 * config.vocab_size
    assert learned_ppl < random_ppl / 10
    assert math.isclose(
        perplexity(learned, tokenizer, yardstick.held_out_texts(), 128),
        yardstick.built["held_out_perplexity"],
        rel_tol=1e-3,
    )
    # Built once: a second call finds the folder by its key instead of training again.
    again = build_yardstick(yardstick.model.parent)
    assert again.built == yardstick.built


def test_held_out_files_are_never_trained_or_calibrated_on(yardstick):
    train, held_out = corpus_files(YardstickSpec())
    assert held_out and not set(train) & set(held_out)
    assert yardstick.built["held_out_files"] == [f.name for f in held_out]
    calibration = {
        json.loads(line)["text"] for line in yardstick.calibration.read_text().splitlines()
    }
    held_out_texts = yardstick.held_out_texts()
    assert len(held_out_texts) >= 512 and not calibration & set(held_out_texts)
    # Every held-out piece comes from a held-out file and is found in no training file; no
    # calibration piece is found in a held-out file (the library repeats code between modules).
    held_out_source = "\0".join(f.read_text(errors="replace") for f in held_out)
    train_source = "\0".join(f.read_text(errors="replace") for f in train)
    assert all(text in held_out_source for text in held_out_texts)
    assert not any(text in train_source for text in held_out_texts)
    assert not any(text in held_out_source for text in calibration)


def test_gptq_beats_round_to_nearest_at_4_bits(increase):
    assert increase["RTN_W4A16"] >= 2.0, "the yardstick no longer tells 4-bit schemes apart"
    assert increase["W4A16"] < increase["RTN_W4A16"] - 1.0


def test_8_bit_schemes_stay_near_the_base(increase):
    assert increase["W8A8"] < 0.1  # 3x the worst of 6 runs
    assert increase["FP8_DYNAMIC"] < 0.6  # FP8 keeps 3 mantissa bits: coarser than int8's 8


def test_every_scheme_passes_its_familys_limits_and_the_manifest_states_them(increase, test_root):
    """Verification ran with the defaults: each output met its scheme family's limits, and the
    manifest holds the limits beside the figures."""
    from compressflow.registries.thresholds import DEFAULTS, scheme_family
    from compressflow.store.manifest import read_manifest

    for name in increase:
        manifest = read_manifest(test_root / "yardstick-outputs" / name)
        verification, scheme = manifest.verification, manifest.result.scheme
        limits = DEFAULTS[scheme_family(scheme)]
        assert verification.passed
        assert verification.logit_limits == {
            "min_cosine": limits.cosine,
            "max_kl": limits.kl,
            "min_top1": limits.top1,
        }
        assert verification.kl_divergence <= limits.kl
        assert verification.top1_agreement >= limits.top1


def test_a_folder_holding_other_files_is_refused_before_training(tmp_path):
    (tmp_path / "notes.txt").write_text("the user's")
    with pytest.raises(FileExistsError, match="notes.txt"):
        build_yardstick(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
