"""Every flow's parameter groups, by one name: the Prefect UI form, the validation and the docs.

Each group lives in the slice it configures (`model/args.py`: `ModelArgs`, `data/args.py`,
`recipes/args.py`, `calibration/args.py`, `store/args.py`, `reporting/args.py`,
`verification/args.py`, `evaluation/args.py`) on the shared base in `compressflow/arguments.py`;
names follow the seed system's `LLMCompressorTask` (`model_id`, `recipe_args`, `dataset_name`,
`text_samples`, `max_seq_len`, `tags`, ...) where the meaning is the same. They hold no secrets:
hub tokens and ClearML keys come from blocks or the environment. This module names them all, as
it always has, for the flows, the README's examples and users' code."""

from __future__ import annotations

from compressflow.arguments import (
    BLOCK_NAME_OR_EMPTY,
    IMPORT_PATH_OR_EMPTY,
    TAG,
    Args,
    block_name,
    plain_path,
)
from compressflow.calibration.args import (
    GPU_SHARE,
    CalibrationArgs,
)
from compressflow.data.args import (
    DatasetArgs,
    HeldOutArgs,
    TextSourceArgs,
)
from compressflow.evaluation.args import (
    METRICS,
    Deployments,
    LmEvalArgs,
    Objective,
    QualityGate,
    SearchSpace,
    ServedArgs,
)
from compressflow.model.args import (
    DEFAULT_MODEL_CLASS,
    ModelArgs,
)
from compressflow.recipes.args import (
    MAX_TARGET_ROUNDS,
    PresetName,
    RecipeArgs,
    TargetArgs,
)
from compressflow.reporting.args import (
    TrackingArgs,
)
from compressflow.store.args import (
    OutputArgs,
)
from compressflow.verification.args import (
    VerifyArgs,
)

__all__ = [
    "IMPORT_PATH_OR_EMPTY",
    "BLOCK_NAME_OR_EMPTY",
    "TAG",
    "block_name",
    "plain_path",
    "Args",
    "DEFAULT_MODEL_CLASS",
    "ModelArgs",
    "TextSourceArgs",
    "DatasetArgs",
    "HeldOutArgs",
    "PresetName",
    "RecipeArgs",
    "MAX_TARGET_ROUNDS",
    "TargetArgs",
    "GPU_SHARE",
    "CalibrationArgs",
    "OutputArgs",
    "TrackingArgs",
    "VerifyArgs",
    "QualityGate",
    "ServedArgs",
    "LmEvalArgs",
    "METRICS",
    "SearchSpace",
    "Objective",
    "Deployments",
]
