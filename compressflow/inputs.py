"""A run's inputs as one typed, picklable bundle, handed whole to the stages that need them.

`RunArgs` holds the parameter groups a compress-model run was given; `Inputs` adds what the cheap
stages resolved from them (the rendered recipe, the fetched model, the built dataset, the output
folder and the run key). A target search calibrates, verifies and publishes other renderings of
the recipe: `with_recipe` gives the same inputs for one of them. The flow builds `RunArgs` from its parameters, `resolve_inputs` turns it
into `Inputs`, and calibrate, verify, plan memory and publish each take the bundle, not ten
arguments unpacked from it. Both are pydantic models: a Prefect worker pickles task inputs, and a
child process receives them whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from compressflow.calibration.args import CalibrationArgs
from compressflow.data.args import DatasetArgs
from compressflow.data.result import BuiltDataset
from compressflow.model.args import ModelArgs
from compressflow.model.result import FetchedModel
from compressflow.recipes.args import RecipeArgs, TargetArgs
from compressflow.recipes.result import RenderedRecipe
from compressflow.store.args import OutputArgs
from compressflow.verification.args import VerifyArgs


class RunArgs(BaseModel):
    """The parameter groups of one compress-model run, as the flow was given them (tracking
    aside: it says where the run is logged, not what it makes)."""

    model_config = ConfigDict(frozen=True, protected_namespaces=())

    model: ModelArgs
    dataset: DatasetArgs = DatasetArgs()
    recipe: RecipeArgs = RecipeArgs()
    output: OutputArgs = OutputArgs()
    verify: VerifyArgs = VerifyArgs()
    calibration: CalibrationArgs = CalibrationArgs()
    target: TargetArgs = TargetArgs()

    def recorded(self) -> dict[str, Any]:
        """Every group as plain data: what the manifest and ClearML record as the run's inputs."""
        return {name: getattr(self, name).model_dump() for name in type(self).model_fields}


class Inputs(BaseModel):
    """What the cheap stages resolved from `args`, and where the output goes."""

    model_config = ConfigDict(frozen=True, protected_namespaces=())

    args: RunArgs
    recipe: RenderedRecipe
    model: FetchedModel
    dataset: BuiltDataset | None
    target: Path
    key: str

    def with_recipe(self, recipe: RenderedRecipe) -> Inputs:
        """The same inputs for another rendered recipe: a target search's round (the run key and
        the output stay those of the run)."""
        return self.model_copy(update={"recipe": recipe})


class InputCheck(BaseModel):
    """One of `compressflow validate`'s checks: its name, time and what it found."""

    name: str
    seconds: float
    detail: str


class ValidationReport(BaseModel):
    """What `compressflow validate` reports: each check, and the output the run would publish."""

    checks: list[InputCheck]
    output_path: str
    reuses_output: bool

    def table(self) -> str:
        rows = [f"  {c.name:<14} {c.seconds:6.2f} s  {c.detail}" for c in self.checks]
        return "\n".join(["Parameters are valid:", *rows])
