"""Build held-out text: evaluation samples the compressed model was not calibrated on.

When the evaluation text comes from the dataset that calibrated the model (read from the
published manifest), the calibration samples are rebuilt exactly as the dataset stage drew them
(same seed, same formatting, `compressflow.data.text_sources`) and removed before sampling
(`compressflow.data.build.held_out_text`, in a child).
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from compressflow.data.build import held_out_text
from compressflow.logs import run_logger
from compressflow.params import DatasetArgs
from compressflow.results import FetchedModel, HeldOutText
from compressflow.runtime.isolation import in_child


@task(name="build held-out text", cache_policy=NO_CACHE)
def build_held_out(
    args: DatasetArgs, model: FetchedModel, calibration: DatasetArgs | None
) -> HeldOutText:
    """`args.text_samples` texts from `args`' source, without the rows calibration used."""
    held_out = in_child(held_out_text, args, model, calibration)
    run_logger(__name__).info(
        "Held-out text: %d samples from %s (%d calibration rows left out)",
        len(held_out.input_ids),
        held_out.source,
        held_out.excluded_calibration_samples,
    )
    return held_out
