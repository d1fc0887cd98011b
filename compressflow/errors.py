"""Errors a user can fix. Each names what is wrong, with the offending value, and the fix.

They are raised before expensive work where possible (validation runs before weights load), and
the flow lets them through unchanged so the Prefect UI shows the message as written.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


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


@contextmanager
def interpreting(
    field: str,
    source: Path | str,
    error: type[InputError] = InputError,
    doing: str = "the library that reads it refuses",
    fix: str = "",
    said=first_line,
    more: str = "",
) -> Iterator[None]:
    """Fault by provenance: what a library raises while it interprets `source`, an input the user
    gave through `field` (config.json as the model class is built from it, the tokenizer's files,
    a data file), is that input's refusal, not a defect of ours.

    Wrap the one library call that reads the input, nothing else: inside the block any exception
    but ours becomes `error(field, "<doing> <source> (at its key K: V): <the library's words>",
    fix)`, where K is a key of a JSON `source` that those words name, when they name one; the
    fix, unless given, is to correct K (or the setting named) or restore the file, and `more`. What
    escapes outside such a block is still the stage boundary's `StageDefect`. A stage limit's
    TimeoutError and a MemoryError are no input's fault: they pass. `said` gives the library's
    words (default `first_line`).
    """
    try:
        yield
    except CompressflowError:
        raise
    except (TimeoutError, MemoryError):
        raise
    except Exception as exc:
        words = said(exc)
        file = Path(source)
        found = key_named(words, file)
        at = f" (at its key {found[0]}: {json.dumps(found[1])[:80]})" if found else ""
        default = (
            f"correct {found[0] if found else 'the setting the message names'} in {file.name}, "
            f"or replace {file.name} with the model's original{more}"
        )
        # `doing` places the source itself where it says {source}; else the source follows it.
        what = (
            doing.replace("{source}", str(source)) if "{source}" in doing else f"{doing} {source}"
        )
        raise error(field, f"{what}{at}: {words}", fix or default) from exc


# Key names this short are words the libraries use for other things ("type", "name").
_SHORTEST_KEY = 5
_WALKED = 20_000  # values looked at, at most: a tokenizer.json's vocabulary holds 100,000s


def key_named(words: str, file: Path) -> tuple[str, Any] | None:
    """The (dotted key, value) of JSON `file` that a library's `words` name: a string value they
    quote (`'nonsense'`, `torch.int8`; the deepest), else a key whose name they use (the first).
    None when the file is no readable JSON object, or the words name none of it."""
    if file.suffix != ".json" or not file.is_file() or file.stat().st_size > 16 << 20:
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    by_name: list[tuple[int, str, Any]] = []
    by_value: list[tuple[str, Any]] = []
    for dotted, key, value in _walk(data):
        if len(key) >= _SHORTEST_KEY or "_" in key:
            if match := re.search(rf"(?<![\w]){re.escape(key)}(?![\w])", words):
                by_name.append((match.start(), dotted, value))
        if isinstance(value, str) and len(value) >= 2:
            if re.search(rf"['\"`=.]{re.escape(value)}(?![\w])", words):
                by_value.append((dotted, value))
    if by_value:  # the more telling: transformers 5 names rope_parameters for a rope_scaling
        return max(by_value, key=lambda hit: hit[0].count("."))
    if by_name:
        _, dotted, value = min(by_name, key=lambda hit: (hit[0], hit[1].count(".")))
        return dotted, value
    return None


def _walk(data: Any, prefix: str = "", depth: int = 3) -> Iterator[tuple[str, str, Any]]:
    """(dotted key, key, value) of an object's entries, `depth` levels down, `_WALKED` at most."""
    if not isinstance(data, dict):
        return
    stack, walked = [(prefix, data, depth)], 0
    while stack and walked < _WALKED:
        where, mapping, left = stack.pop(0)
        for key, value in mapping.items():
            walked += 1
            dotted = f"{where}.{key}" if where else str(key)
            yield dotted, str(key), value
            if isinstance(value, dict) and left > 1:
                stack.append((dotted, value, left - 1))
            if walked >= _WALKED:
                break
