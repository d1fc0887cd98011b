"""The model card: Hugging Face front matter, the license carried from the source, and the
evaluation section evaluate-model adds to a folder compressflow published (and to no other; the
shared run's card gaining it is checked in test_evaluate, on the evaluation it already runs, and
a symlinked card of the shared run in test_model_card_symlink)."""

from __future__ import annotations

import pytest

from compressflow.registries.presets import KV_CACHE_FP8
from compressflow.reporting.model_card import (
    CARD,
    EVALUATION_START,
    add_evaluation,
    kv_cache_line,
    source_license,
    verification_list,
    with_evaluation,
)
from compressflow.results import ServingCheck, Verification, VerificationCheck


def test_the_license_comes_from_the_sources_own_card(tmp_path):
    (tmp_path / CARD).write_text("---\nlicense: apache-2.0\ntags: [a]\n---\n\n# Model\n")
    assert source_license(tmp_path) == "apache-2.0"


@pytest.mark.parametrize(
    "text",
    [
        "---\nlicense: [unclosed\n---\n",  # malformed front matter
        "# no front matter\n",
        "---\n" + "x: 1\n" * 400_000 + "---\n",  # larger than any card: not parsed
    ],
)
def test_a_card_we_cannot_read_names_no_license(tmp_path, text):
    (tmp_path / CARD).write_text(text)
    assert source_license(tmp_path) is None


def test_a_later_evaluation_replaces_the_earlier_section():
    card = "# Card\n\nbody\n"
    once = with_evaluation(
        card, f"{EVALUATION_START}\nfirst\n<!-- compressflow: end of evaluation -->\n"
    )
    twice = with_evaluation(
        once, f"{EVALUATION_START}\nsecond\n<!-- compressflow: end of evaluation -->\n"
    )
    assert twice.count(EVALUATION_START) == 1 and "second" in twice and "first" not in twice
    assert twice.startswith(card.rstrip("\n"))


def test_a_folder_compressflow_did_not_publish_is_never_written(tmp_path):
    user = tmp_path / "user-model"
    user.mkdir()
    (user / CARD).write_text("# The user's own card, mentioning compressflow\n")
    before = (user / CARD).read_bytes()
    assert not add_evaluation(user, "section")
    assert (user / CARD).read_bytes() == before and sorted(p.name for p in user.iterdir()) == [CARD]


def test_verification_is_a_list_a_long_or_odd_detail_cannot_break():
    """A table cell does not wrap in Prefect's artifact view, and a library's `|` or newline
    would end a row: one line per check, its detail on one line, a failure in bold."""
    long = "cosine 0.9981 (min 0.9), KL 0.0147 nats (max 0.0864), " * 4
    checks = [
        VerificationCheck(name="logits", passed=True, detail=long),
        VerificationCheck(name="reload", passed=False, detail="ValueError: a | b\nc"),
        VerificationCheck(name="vllm", passed=False, checked=False, detail="no kernel"),
    ]
    text = verification_list(Verification(passed=False, checks=checks, seconds=1.0))
    assert text.splitlines() == [
        f"- **logits**: pass: {long.strip()}",
        "- **reload**: **FAIL**: ValueError: a | b c",
        "- **vllm**: not checked here: no kernel",
    ]


def test_an_fp8_kv_cache_is_on_the_card_with_how_to_serve_it_and_what_vllm_here_did():
    served = ServingCheck(outcome="served", vllm_version="0.32.0", kv_cache_dtype="fp8")
    line = kv_cache_line(KV_CACHE_FP8, served)
    assert line.startswith("- **KV cache**: FP8 (E4M3) with calibrated per-tensor scales")
    assert "`--kv-cache-dtype fp8`" in line
    assert "served here by vLLM 0.32.0 with `kv_cache_dtype=fp8`" in line
    refused = "no FP8 KV cache in this vLLM build for this CPU or head size (...)"
    not_checked = ServingCheck(outcome="not checked", reason=refused)
    assert "not served here (not checked: see vLLM above)" in kv_cache_line(
        KV_CACHE_FP8, not_checked
    )
    assert "vLLM did not run here" in kv_cache_line(KV_CACHE_FP8, None)
    assert kv_cache_line(None, served) == ""  # the KV cache in the model's dtype: no line
