"""Errors a user can fix. Each names what is wrong, with the offending value, and the fix.

They are raised before expensive work where possible (validation runs before weights load), and
the flow lets them through unchanged so the Prefect UI shows the message as written.
"""

from __future__ import annotations


class CompressflowError(Exception):
    """Base class: a problem in the inputs or the environment that the user can fix."""


class InputError(CompressflowError, ValueError):
    """A parameter is wrong. `field` is its dotted name, e.g. `recipe.recipe_args`."""

    def __init__(self, field: str, problem: str, fix: str):
        self.field, self.problem, self.fix = field, problem, fix
        super().__init__(f"{field}: {problem}. Fix: {fix}")


class RecipeError(InputError):
    """The recipe cannot be rendered or llm-compressor's parser rejects it."""


class DatasetError(InputError):
    """The calibration dataset cannot be loaded, sampled or tokenized as asked."""


class ModelFetchError(InputError):
    """The model cannot be found or downloaded."""


class TraceabilityError(CompressflowError):
    """The sequential pipeline cannot trace the model with this data."""


class PublishError(CompressflowError):
    """The output cannot be published where asked."""
