"""The quality table's method rows: the rotation goal's arithmetic, and logits figures grouped by
method (what METHOD_MEASURED is read from), without running a flow."""

from __future__ import annotations

from benchmarks.quality_table import QUIP, Row, goals, verify_figures


def _row(name: str, ppl: list[float], verify=(0.999, 0.01, 0.9), scheme="W4A16") -> Row:
    return Row(
        name,
        bf16=False,
        data=True,
        ppl=ppl,
        base_ppl=[40.0] * len(ppl),
        verify=[verify] * len(ppl),
        scheme=scheme,
    )


def test_the_rotation_goal_is_the_share_of_gptqs_median_loss_it_closes():
    gptq = _row("W4A16", [40.9, 41.0, 41.2])  # median loss 1.0
    closes_half = _row(QUIP, [40.4, 40.5, 40.6])
    closes_a_tenth = _row(QUIP, [40.9, 40.9, 41.0])
    [(_, value, met)] = goals({"W4A16": gptq, QUIP: closes_half})
    assert met and "50% closed" in value
    [(_, value, met)] = goals({"W4A16": gptq, QUIP: closes_a_tenth})
    assert not met and "10% closed" in value
    assert goals({"W4A16": gptq}) == []


def test_method_rows_are_grouped_by_method_not_by_scheme():
    rows = [
        _row("W4A16", [41.0], verify=(0.998, 0.012, 0.88)),
        _row(QUIP, [40.5], verify=(0.999, 0.006, 0.92)),
        _row("REAP_W4A16", [42.0], verify=(0.99, 0.05, 0.8)),
        _row("REAP", [41.5], verify=(0.995, 0.03, 0.85), scheme=None),
    ]
    lines = verify_figures(rows).splitlines()
    by_group = {line.split(" | ")[0].strip("| "): line for line in lines[2:]}
    assert set(by_group) == {"4-bit weights", "rotation", "expert pruning"}
    # The worst of each figure over the method's rows, each from whichever row had it.
    assert "REAP_W4A16, REAP | 0.99000 | 0.0500 | 0.8000" in by_group["expert pruning"]
    assert "| W4A16 | 0.99800 | 0.0120 | 0.8800 |" in by_group["4-bit weights"]
