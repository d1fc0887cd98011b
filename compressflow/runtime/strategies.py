"""What a target strategy is: one way a run calibrates to its target, with one signature for all.

A run calibrates its recipe as asked (no target), searches for the fewest modules left
unquantized that meet a perplexity ratio, or mixes precisions to a bits budget or a ratio. Each
of these is a `Strategy`: its name, whether it `applies` to a run's recipe and target (exactly
one does), the refusal it makes before anything loads (`check`), and `run`, which calibrates and
returns what the run verifies and publishes. A strategy runs stages (calibrate, measure
perplexity, ...) through the `Calibrating` it is given: an object, not functions to call back.

The strategies live beside their stages (tasks/calibrate.py, tasks/search_target.py,
tasks/mix_precision.py), which may not import one another; the registry that lists them and the
`Calibrating` the compress flow gives them are in flows/strategies.py, the one
layer that sees every stage. This module is the shape they share, below both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from compressflow.inputs import Inputs
from compressflow.params import TargetArgs
from compressflow.results import Calibration, HeldOutText, RenderedRecipe, TargetSearch

# What a strategy hands the flow: the calibration to verify and publish, the recipe it was
# calibrated with, and what the search tried (None for the recipe as asked).
Outcome = tuple[Calibration, RenderedRecipe, TargetSearch | None]


class Calibrating(Protocol):
    """What a strategy is given: the run's inputs and held-out text, and the stages it runs."""

    inputs: Inputs
    held_out: HeldOutText | None  # built when the run has a target

    def run(self, stage: Any, *args: Any) -> Any:
        """Run `stage` (a Prefect task) inside its boundary, and record it."""

    def calibrate(self, recipe: RenderedRecipe) -> Calibration:
        """Calibrate `recipe` into a staging folder of its own; the flow deletes every staging
        folder but the published one at the end, so a strategy deletes only the ones it drops."""

    def perplexity(self, path: str) -> float:
        """Held-out perplexity of the checkpoint at `path` (the base, or a staged output)."""


def nothing_to_check(recipe: RenderedRecipe, target: TargetArgs) -> None:
    """The check of a strategy that any rendered recipe can run."""


@dataclass(frozen=True)
class Strategy:
    """One target strategy: `applies(recipe, target)` chooses it; `check(recipe, target)` refuses,
    before anything downloads, what it cannot do; `run(calibrating)` calibrates."""

    name: str
    applies: Callable[[RenderedRecipe, TargetArgs], bool]
    run: Callable[[Calibrating], Outcome]
    check: Callable[[RenderedRecipe, TargetArgs], None] = nothing_to_check
