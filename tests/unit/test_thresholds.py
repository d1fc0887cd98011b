"""Verify's logits limits per scheme family: derived from learned-weights measurements by one
rule, applied by scheme, and overridden by what the user sets."""

from __future__ import annotations

import pytest

from compressflow.params import VerifyArgs
from compressflow.registries.thresholds import (
    DEFAULTS,
    FAMILY_ORDER,
    FLOOR,
    MEASURED,
    METHOD_DEFAULTS,
    METHOD_MEASURED,
    default_limits,
    limits_from,
    loosest,
    scheme_family,
)


@pytest.mark.parametrize(
    ("scheme", "family"),
    [
        ("W4A16", "4-bit weights"),
        ("W4A16_ASYM", "4-bit weights"),
        ("W4AFP8", "4-bit weights"),
        ("NVFP4A16", "4-bit weights"),
        ("NVFP4", "4-bit weights and activations"),
        ("MXFP4", "4-bit weights and activations"),
        ("W4A4", "4-bit weights and activations"),
        ("W8A8", "8-bit"),
        ("W8A16", "8-bit"),
        ("FP8_DYNAMIC", "8-bit"),
        ("FP8_BLOCK", "8-bit"),
        ("W2A16", "other"),
        (None, "other"),
        ("W8A8+W4A16", "4-bit weights"),  # the loosest part decides
        ("W8A8+custom", "other"),
    ],
)
def test_a_scheme_belongs_to_the_family_of_its_weight_bits(scheme, family):
    assert scheme_family(scheme) == family


def test_each_familys_limits_loosen_its_worst_healthy_figure():
    for family, worst in MEASURED.items():
        limits = DEFAULTS[family]
        assert limits == limits_from(worst)
        # An output as good as the worst measured passes its family's limits.
        assert worst.cosine >= limits.cosine and worst.kl <= limits.kl and worst.top1 >= limits.top1
    # 8-bit outputs are held closer to the base than 4-bit ones, and both closer than the floor.
    order = [DEFAULTS[f] for f in reversed(FAMILY_ORDER)]  # strictest first
    assert [d.kl for d in order] == sorted(d.kl for d in order)
    assert [d.top1 for d in order] == sorted((d.top1 for d in order), reverse=True)
    assert DEFAULTS["other"] == FLOOR


def test_the_family_default_applies_unless_the_user_set_a_limit():
    assert VerifyArgs().logit_limits("FP8_DYNAMIC") == DEFAULTS["8-bit"]
    assert VerifyArgs().logit_limits("W4A16") == DEFAULTS["4-bit weights"]
    assert VerifyArgs().logit_limits("NVFP4") == DEFAULTS["4-bit weights and activations"]
    assert VerifyArgs().logit_limits(None) == FLOOR
    mixed = VerifyArgs(max_kl=0.5).logit_limits("W8A8")
    assert mixed.kl == 0.5
    assert (mixed.cosine, mixed.top1) == (DEFAULTS["8-bit"].cosine, DEFAULTS["8-bit"].top1)


def test_the_run_form_states_every_familys_defaults():
    text = VerifyArgs.model_fields["min_cosine"].description
    for family, limits in DEFAULTS.items():
        assert f"{family}: cosine {limits.cosine}, KL {limits.kl}, top-1 {limits.top1}" in text


def test_each_methods_limits_loosen_its_worst_healthy_figure():
    for method, worst in METHOD_MEASURED.items():
        limits = METHOD_DEFAULTS[method]
        assert limits == limits_from(worst)
        assert worst.cosine >= limits.cosine and worst.kl <= limits.kl and worst.top1 >= limits.top1


@pytest.mark.parametrize("scheme", ["W8A8", "W4A16", "NVFP4", None])
def test_a_method_is_held_to_its_own_limits_or_its_schemes_where_looser(scheme):
    for method, own in METHOD_DEFAULTS.items():
        limits, source = default_limits(scheme, method)
        family = DEFAULTS[scheme_family(scheme)]
        # The method alone (nothing quantized) is held to its own limits, not the floor's.
        assert limits == (loosest(own, family) if scheme else own)
        assert source.startswith(f"the {method} default")
        assert VerifyArgs().logit_limits(scheme, method) == limits


def test_a_method_not_measured_takes_its_schemes_limits_and_says_so():
    limits, source = default_limits("W4A16", "a method nobody measured")
    assert limits == DEFAULTS["4-bit weights"]
    assert source == (
        "the 4-bit weights default (W4A16), as no a method nobody measured default is measured yet"
    )
