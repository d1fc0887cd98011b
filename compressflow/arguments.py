"""What every parameter group shares: the base class (unknown keys refused, None means the
default) and the validators for block names and plain paths.

Each slice's own groups live beside its logic (`model/args.py`, `data/args.py`, ...);
`compressflow.params` names them all for flows, the README and users' code."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, model_validator

from compressflow.errors import InputError

IMPORT_PATH_OR_EMPTY = r"^([A-Za-z_][\w.]*:[A-Za-z_]\w*)?$"


# Prefect's rule for block document names (prefect.types.names.BlockDocumentName). A token pasted
# into a `*_block` field (hf_..., a ClearML key) breaks it: refused here and by the deployment's
# schema, it never reaches a run's parameters, the manifest or ClearML.
BLOCK_NAME_OR_EMPTY = r"^[a-z0-9-]*$"


TAG = r"^[^\x00-\x1f\x7f]+$"  # no newline or other control character


def block_name(value: Any, field: str) -> Any:
    """`value` when it can name a block. Refused without repeating it: it may be the secret."""
    if isinstance(value, str) and not re.fullmatch(BLOCK_NAME_OR_EMPTY, value):
        raise InputError(
            field,
            "the value (not shown) looks like a secret value, not a block name: block names are "
            "lowercase letters, digits and dashes",
            "give the name of the block that holds the secret, never the secret itself (and "
            "revoke a token that was pasted here)",
        )
    return value


def plain_path(group: str):
    """A validator refusing a path or id field that holds a NUL byte (every file-system call on
    it raised a bare "ValueError: embedded null byte" from deep inside a check) or spaces at
    either end (a pasted path: "   " made a folder of spaces in the worker's directory)."""

    def check(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str) and "\x00" in value:
            raise InputError(
                f"{group}.{info.field_name}",
                f"{value[:60]!r} holds a NUL byte (\\x00), which no file or folder name can hold",
                "remove it (copying from a binary file or a C string brings one in)",
            )
        if isinstance(value, str) and value != value.strip():
            raise InputError(
                f"{group}.{info.field_name}",
                f"{value[:60]!r} has spaces at its start or end, which a pasted path brings in",
                f"give it as {value.strip()[:60]!r}"
                if value.strip()
                else "give a path, or leave it empty for the default",
            )
        return value

    return check


class Args(BaseModel):
    # Unknown keys are typos in a deployment's parameters: refuse them instead of ignoring them.
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _none_means_default(cls, data: Any) -> Any:
        """No field takes None: unset text, lists and limits are "", [] or 0, because the Prefect
        UI shows a `str | None` type toggle for None-able fields. Callers that still pass None get
        the default (an unknown key stays, to be refused as one)."""
        if not isinstance(data, dict):
            return data
        return {
            key: value
            for key, value in data.items()
            if value is not None or key not in cls.model_fields
        }
