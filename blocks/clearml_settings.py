"""ClearMLSettings: where a ClearML server is and how to log in, kept out of flow parameters.

Flows take the block's *name* (`tracking.clearml_block`), never its values, so keys stay out of
parameters, logs, manifests and ClearML hyperparameters. Without a block, the SDK's own
configuration applies (CLEARML_* variables or clearml.conf), and without that, offline mode.
"""

from __future__ import annotations

from prefect.blocks.core import Block
from pydantic import Field, SecretStr

from compressflow.errors import InputError


class ClearMLSettings(Block):
    """Credentials and defaults for logging compression runs to a ClearML server."""

    _block_type_name = "ClearML Settings"
    _description = "ClearML server, credentials and defaults used by compressflow's tracking."

    api_host: str = Field(description="API server URL, e.g. https://api.clear.ml")
    web_host: str | None = Field(default=None, description="Web UI URL, e.g. https://app.clear.ml")
    files_host: str | None = Field(
        default=None, description="File server URL, e.g. https://files.clear.ml"
    )
    access_key: SecretStr = Field(description="ClearML API access key.")
    secret_key: SecretStr = Field(description="ClearML API secret key.")
    default_project: str = Field(
        default="compressflow", description="Project used when a run names none."
    )
    output_uri: str | None = Field(
        default=None,
        description="Where ClearML stores uploaded models and artifacts (e.g. s3://bucket/path); "
        "the files host when empty.",
    )
    connect_timeout_seconds: float = Field(
        default=10.0, gt=0, description="How long to wait for the server before logging offline."
    )


def load_clearml_settings(block_name: str) -> ClearMLSettings | None:
    """The block a run's `tracking.clearml_block` names; None when it names none."""
    if not block_name:
        return None
    try:
        return ClearMLSettings.load(block_name)
    except ValueError as exc:
        raise InputError(
            "tracking.clearml_block",
            f"no ClearMLSettings block named {block_name!r} ({exc})",
            "create it with `python -m compressflow.blocks.register` or fix the name",
        ) from exc
