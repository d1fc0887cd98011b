"""Build dataset: samples, templates and tokenizes the calibration data, and caches it.

How is `compressflow.data.build` (image+text rows: `compressflow.data.vision`); this stage runs it
in a child, with the folder it saves into, `$COMPRESSFLOW_CACHE_DIR/datasets`, where the dataset's
fingerprint names its copy, so the same data built twice lands in, and reuses, the same folder.
"""

from __future__ import annotations

from prefect import task

from compressflow.data.build import build
from compressflow.errors import DatasetError
from compressflow.logs import run_logger
from compressflow.params import DatasetArgs
from compressflow.reporting import tracking
from compressflow.results import BuiltDataset, FetchedModel
from compressflow.runtime.isolation import in_child
from compressflow.settings import cache_root
from compressflow.store.caching import CACHE_EXPIRATION, LocalSourceAware


@task(
    name="build dataset",
    cache_policy=LocalSourceAware(),
    cache_expiration=CACHE_EXPIRATION,
    persist_result=True,
)
def build_dataset(
    args: DatasetArgs, model: FetchedModel, needs_data: bool = True
) -> BuiltDataset | None:
    """Build the calibration dataset for `model`, or return None when the recipe needs none."""
    logger = run_logger(__name__)
    if not needs_data:
        logger.info("The recipe needs no calibration data: no dataset is built")
        return None
    if args.text_samples == 0 and args.vision_samples == 0:
        raise DatasetError(
            "dataset.text_samples",
            "the recipe needs calibration data but text_samples and vision_samples are both 0",
            "set text_samples (e.g. 256) or, for a vision-language model, vision_samples",
        )
    built = in_child(build, args, model, cache_root() / "datasets")
    stats = built.token_stats
    logger.info(
        "Built %d samples from %s: %d to %d tokens (mean %.0f, total %d), chat template %s; %s",
        built.num_samples,
        built.source,
        stats["min"],
        stats["max"],
        stats["mean"],
        stats["total"],
        "applied" if built.chat_template_applied else "not applied",
        built.path,
    )
    tracking.log_result(built)
    return built
