"""The target strategies by name, and the `Calibrations` the compress flow gives the chosen one.

Each strategy (compressflow/runtime/strategies.py says what one is) lives beside its stage: the
recipe as asked (tasks/calibrate.py), the search that leaves modules unquantized
(tasks/search_target.py), the precision mix (tasks/mix_precision.py). A new one is a module of
its own and one line here. They are listed here, not below, because stages may not import one
another: only this layer sees the calibrate stage, the perplexity stage and every strategy.
`choose` asks them in order; exactly one applies to a run's recipe and target.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compressflow.inputs import Inputs
from compressflow.params import TargetArgs
from compressflow.results import Calibration, HeldOutText, MemoryPlan, RenderedRecipe
from compressflow.runtime.stages import Stages
from compressflow.runtime.strategies import Strategy
from compressflow.store.staging import staging_path
from compressflow.tasks.calibrate import AS_ASKED, calibrate
from compressflow.tasks.mix_precision import MIX_PRECISION
from compressflow.tasks.search_target import SEARCH_TARGET, measure_perplexity

STRATEGIES: dict[str, Strategy] = {
    strategy.name: strategy for strategy in (MIX_PRECISION, SEARCH_TARGET, AS_ASKED)
}


def choose(recipe: RenderedRecipe, target: TargetArgs) -> Strategy:
    """The strategy that meets `target` with `recipe`: the first in STRATEGIES that applies."""
    return next(strategy for strategy in STRATEGIES.values() if strategy.applies(recipe, target))


class Calibrations:
    """The compress flow's `Calibrating`: its stages run through the run's `Stages` (recorded,
    each in its boundary), and every staging folder a calibration made is kept in `stagings`,
    which the flow deletes at the end (the published one is renamed away before)."""

    def __init__(
        self, stages: Stages, inputs: Inputs, plan: MemoryPlan, held_out: HeldOutText | None
    ):
        self.stages, self.inputs, self.plan, self.held_out = stages, inputs, plan, held_out
        self.stagings: list[Path] = []

    def run(self, stage: Any, *args: Any) -> Any:
        return self.stages.run(stage, *args)

    def calibrate(self, recipe: RenderedRecipe) -> Calibration:
        self.stagings.append(staging_path(self.inputs.target))
        limit = self.inputs.args.calibration.timeout_minutes * 60 or None
        return self.stages.run(
            calibrate.with_options(timeout_seconds=limit),
            self.inputs.with_recipe(recipe),
            self.plan,
            str(self.stagings[-1]),
        )

    def perplexity(self, path: str) -> float:
        return self.stages.run(measure_perplexity, path, self.inputs.model, self.held_out)
