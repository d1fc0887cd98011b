"""What stages return, by one name: small typed results the flow passes forward, and workers pickle.

Each type lives in the slice whose stage returns it (`model/result.py`: `FetchedModel`,
`MemoryPlan`; `data/result.py`, `recipes/result.py`, `calibration/result.py`,
`verification/result.py`, `store/result.py`, `evaluation/result.py`; `inputs.py`: the validate
report). They live in installed modules with stable names (not in a flow file a worker loads by
path), so a result pickled by one process unpickles in another; this module names them all, as it
always has, so results pickled under these names, the README's examples and users' code keep
working. A stage takes the results it needs as arguments and never imports another stage to get
a type."""

from __future__ import annotations

from compressflow.calibration.result import (
    Calibration,
    LayerTime,
    ModuleMetric,
)
from compressflow.data.result import (
    BuiltDataset,
    HeldOutText,
)
from compressflow.evaluation.result import (
    EvaluationReport,
    LmEvalScores,
    Point,
    PointResult,
    ServedFigure,
    ServedLevel,
    ServedPerformance,
    SweepReport,
)
from compressflow.inputs import InputCheck, ValidationReport
from compressflow.model.result import (
    FetchedModel,
    MemoryPlan,
    TraceReport,
    gib,
    gpu_limit,
)
from compressflow.recipes.result import (
    MixedPrecision,
    MixPoint,
    ModuleSensitivity,
    RenderedRecipe,
    Sensitivity,
    TargetRound,
    TargetSearch,
)
from compressflow.store.result import (
    PublishedModel,
    StageRecord,
)
from compressflow.verification.result import (
    QualityMetrics,
    ServingCheck,
    Verification,
    VerificationCheck,
)

# The validate report's row, by its old name (verification's `Check` is another thing).
Check = InputCheck

__all__ = [
    "FetchedModel",
    "TraceReport",
    "gib",
    "gpu_limit",
    "MemoryPlan",
    "BuiltDataset",
    "HeldOutText",
    "RenderedRecipe",
    "ModuleSensitivity",
    "Sensitivity",
    "MixPoint",
    "MixedPrecision",
    "TargetRound",
    "TargetSearch",
    "ModuleMetric",
    "LayerTime",
    "Calibration",
    "QualityMetrics",
    "VerificationCheck",
    "ServingCheck",
    "Verification",
    "StageRecord",
    "PublishedModel",
    "LmEvalScores",
    "EvaluationReport",
    "ServedFigure",
    "ServedLevel",
    "ServedPerformance",
    "Point",
    "PointResult",
    "SweepReport",
    "InputCheck",
    "ValidationReport",
    "Check",
]
