"""Errors a user can fix. Each names what is wrong, with the offending value, and the fix.

They are raised before expensive work where possible (validation runs before weights load), and
the flow lets them through unchanged so the Prefect UI shows the message as written.
"""

from __future__ import annotations

import difflib


def first_line(exc: BaseException) -> str:
    """`Type: first non-empty line` of an exception (some start with a source dump)."""
    first = next((line for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first[:300].rstrip('.')}"


def closest(word: str, choices: list[str], cutoff: float = 0.5) -> str:
    """A "did you mean ...? " hint for a misspelt name, or "" when nothing is close."""
    close = difflib.get_close_matches(word, choices, n=3, cutoff=cutoff)
    return f"did you mean {' or '.join(close)}? " if close else ""


class CompressflowError(Exception):
    """Base class: a problem in the inputs or the environment that the user can fix.

    `field` is the dotted parameter name it concerns (e.g. `recipe.recipe_args`), or the module,
    file or setting when no parameter is at fault; the message always reads
    `<field>: <problem>. Fix: <fix>`.
    """

    def __init__(self, field: str, problem: str, fix: str):
        self.field, self.problem, self.fix = field, problem, fix
        super().__init__(f"{field}: {problem}. Fix: {fix}")

    def __reduce__(self):
        # Raised in the calibration process, re-raised in the task's: pickle what __init__ takes.
        return (type(self), (self.field, self.problem, self.fix))


class SettingsError(CompressflowError, ValueError):
    """A `COMPRESSFLOW_*` variable of the worker's environment is wrong: the worker's set-up, not
    the run's parameters, is at fault (compressflow.settings)."""


class InputError(CompressflowError, ValueError):
    """A parameter is wrong."""


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


class ResourceError(InputError):
    """The run cannot fit in the worker's memory as asked; said before any weights load."""


class CalibrationError(CompressflowError):
    """llm-compressor failed during calibration in a way no earlier check foresaw."""


class VerificationError(CompressflowError):
    """The compressed checkpoint failed verification; it was not published."""


class HubUnavailableError(CompressflowError, ConnectionError):
    """The hub answered 5xx or 429, or could not be reached: transient, so the fetch retries."""


class EvaluationError(CompressflowError):
    """The evaluation engine could not score a model."""


class QualityThresholdExceeded(CompressflowError):
    """The compressed model lost more quality than the evaluation's thresholds allow."""


class PointFailed(CompressflowError):
    """A point's compression or evaluation did not complete."""


class TargetNotMet(CompressflowError):
    """Compress to a target: no configuration the search could try met the quality target."""


class StageDefect(CompressflowError):
    """Something a stage does not check for escaped it: a defect to report, not an input to fix.

    Every stage's boundary (`compressflow.runtime.stages.boundary`) turns what escapes it into
    this, keeping the library's words in the message and its traceback in the run's log: a raw
    library exception never becomes a run's message.
    """

    @classmethod
    def of(cls, stage: str, exc: BaseException) -> StageDefect:
        return cls(
            f"stage {stage}",
            f"{first_line(exc)}, raised inside the {stage} stage: a defect in compressflow or a "
            "library it calls, not a problem in your parameters that a check knows of",
            "report it with this run's log, which holds the full traceback; meanwhile run "
            "`compressflow validate` on these parameters, and if the words name a model part or "
            "a recipe field, try another model.model_class or recipe",
        )


class StageTimedOut(CompressflowError):
    """A stage ran past the time limit a parameter set for it, and was stopped."""
