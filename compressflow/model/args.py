"""The model source's parameters: which model, from where, loaded by which class."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ConfigDict, Field, field_validator

from compressflow.arguments import BLOCK_NAME_OR_EMPTY, Args, block_name, plain_path

# `module:function`, never serialized source: loaders are imported, not executed from text.
DEFAULT_MODEL_CLASS = "AutoModelForCausalLM"
# `scheme://...`: a model in object storage (compressflow.store.sources reads it; the schemes it
# accepts are compressflow.store.object_uri's), never a hub id or a local folder, which hold no
# `://`. Any scheme counts, so an unsupported one is refused as a URI, not sent to the hub.
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_store_uri(model_id: str) -> bool:
    """Whether `model_id` names a model in object storage (s3://, file://, ...)."""
    return bool(_URI.match(model_id))


class ModelArgs(Args):
    # A token pasted into hub_token_block stays out of a refusal's text (errors() keeps it).
    model_config = ConfigDict(hide_input_in_errors=True)
    _paths = field_validator("model_id", mode="before")(plain_path("model"))

    model_id: str = Field(
        min_length=1,
        description="Hugging Face model id (e.g. meta-llama/Llama-3.2-1B-Instruct), a local "
        "folder, a prefix in object storage (s3://bucket/prefix or file:///abs/path: "
        "downloaded once into the worker's cache), or a ClearML model id when clearml_model is "
        "true.",
    )
    clearml_model: bool = Field(
        default=False, description="model_id is a ClearML model id, fetched with the ClearML SDK."
    )
    revision: str = Field(
        default="",
        description="Hub branch, tag or commit to fetch (empty: main). The resolved commit sha is "
        "recorded either way; pin a sha for reproducible runs.",
    )
    trust_remote_code: bool = Field(
        default=False,
        description="Run the model repository's own Python code. Off unless you trust the repo.",
    )
    model_class: str = Field(
        default=DEFAULT_MODEL_CLASS,
        pattern=r"^[A-Za-z_]\w*$",
        description="transformers class used to load the model; with the default, a model "
        "AutoModelForCausalLM cannot load (e.g. vision-language) uses the class its config names.",
    )
    hub_token_block: str = Field(
        default="",
        pattern=BLOCK_NAME_OR_EMPTY,
        description="Name of a Prefect Secret block holding a Hugging Face token (the name, never "
        "the token). Empty: HF_TOKEN from the worker's environment, if set.",
    )

    storage_credentials: str = Field(
        default="",
        pattern=BLOCK_NAME_OR_EMPTY,
        description="For an s3:// model_id: name of a prefect-aws AwsCredentials block (the "
        "name, never a key). Empty: the worker's environment (AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL for an S3-compatible store).",
    )

    @field_validator("hub_token_block", mode="before")
    @classmethod
    def _a_name_not_a_token(cls, value: Any) -> Any:
        return block_name(value, "model.hub_token_block")  # before the pattern, which echoes

    @field_validator("storage_credentials", mode="before")
    @classmethod
    def _a_name_not_a_key(cls, value: Any) -> Any:
        return block_name(value, "model.storage_credentials")
