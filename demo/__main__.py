"""`make demo`: compress a small local Llama with W4A16 on local text, fully offline.

The model is the learned-weights yardstick (`compressflow.demo.yardstick`): a small Llama trained
here on the standard library's source, so the quality figures the demo prints (verification,
vLLM's perplexity recovery) mean something, as they would not on random weights. It calibrates
on the yardstick's training split. Builds the model under .demo/ if it is missing (about two
minutes on 2 CPUs, once), runs the compress-model flow on Prefect's
local backend with ClearML offline, and prints where the result is, its size against the
original, what vLLM made of it (with `make vllm-env`), its model card and the time each stage
took. Pass a hub model id to compress that model instead:
`python -m compressflow.demo meta-llama/Llama-3.2-1B-Instruct` (needs network, and a token for gated models).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

DEMO_DIR = Path(".demo")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_id", nargs="?", help="hub id or local folder (default: demo model)")
    parser.add_argument("--recipe", default="W4A16", help="preset name or recipe file")
    parser.add_argument("--samples", type=int, default=256, help="calibration samples")
    parser.add_argument("--max-seq-len", type=int, default=256)
    options = parser.parse_args()

    started = time.perf_counter()
    dataset_name, max_seq_len = "python_docs", options.max_seq_len
    if options.model_id is None:
        from compressflow.demo.yardstick import build_yardstick

        print("Building the demo model (trained once, about two minutes; then reused) ...")
        yardstick = build_yardstick(DEMO_DIR / "yardstick")
        options.model_id = str(yardstick.model.resolve())
        dataset_name, max_seq_len = str(yardstick.calibration.resolve()), yardstick.spec.seq_len
    # In the demo's own folder, an output of an earlier demo model (a yardstick built by older
    # code) is replaced: overwrite deletes only the files its manifest lists. A folder the user
    # chose keeps the flow's default, refusal.
    own_folder = "COMPRESSFLOW_OUTPUT_DIR" not in os.environ
    os.environ.setdefault("COMPRESSFLOW_OUTPUT_DIR", str((DEMO_DIR / "outputs").resolve()))

    from compressflow.flows.compress import compress
    from compressflow.params import DatasetArgs, ModelArgs, OutputArgs, RecipeArgs
    from compressflow.reporting.model_card import CARD, vllm_line
    from compressflow.store.manifest import read_manifest

    published = compress(
        model=ModelArgs(model_id=options.model_id),
        dataset=DatasetArgs(
            dataset_name=dataset_name,
            text_samples=options.samples,
            max_seq_len=max_seq_len,
        ),
        recipe=RecipeArgs(recipe=options.recipe),
        output=OutputArgs(overwrite=own_folder),
    )
    print()
    print(f"Compressed model: {published.path}")
    print(
        f"Size: {published.size_bytes / 1e6:.2f} MB, original {published.original_size_bytes / 1e6:.2f} MB "
        f"({published.compression_ratio:.2f}x smaller)"
        + ("  [reused: same model, data and recipe as an earlier run]" if published.reused else "")
    )
    manifest = read_manifest(Path(published.path))
    print(f"vLLM: {vllm_line(manifest.verification.vllm if manifest.verification else None)}")
    print(f"Model card: {Path(published.path, CARD)}")
    print("Stage times:")
    for line in stage_lines(published.stages, manifest.stages if published.reused else []):
        print(f"  {line}")
    print(f"Total, with start-up: {time.perf_counter() - started:.1f} s")


def stage_lines(ran: list, made: list) -> list[str]:
    """Every stage of the pipeline, in its order: this run's, and those of the run that made a
    reused output (`made`, from its manifest, which is written inside publish) that this run
    did not run."""
    this = {stage.name: stage for stage in ran}
    then = {stage.name: stage for stage in made}
    order = [*then, "publish", *this] if made else list(this)
    lines = []
    for name in dict.fromkeys(order):
        if stage := this.get(name):
            lines.append(f"{name:<20} {stage.seconds:8.2f} s{'  (cached)' if stage.cached else ''}")
        elif stage := then.get(name):
            lines.append(f"{name:<20}     not run: reused output ({stage.seconds:.2f} s then)")
        else:
            lines.append(f"{name:<20}     not run: reused output")
    return lines


if __name__ == "__main__":
    main()
