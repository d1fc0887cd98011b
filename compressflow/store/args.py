"""Where a run publishes, and with which tags."""

from __future__ import annotations

import re
from typing import Annotated, Any
from urllib.parse import quote

from pydantic import ConfigDict, Field, field_validator

from compressflow.arguments import BLOCK_NAME_OR_EMPTY, TAG, Args, block_name, plain_path
from compressflow.errors import InputError
from compressflow.store.object_uri import parse_upload_uri


class OutputArgs(Args):
    # A URI pasted with user:password@, or a key pasted as a block name, stays out of a
    # refusal's text (errors() keeps the input otherwise).
    model_config = ConfigDict(hide_input_in_errors=True)
    _paths = field_validator("save_directory", mode="before")(plain_path("output"))

    save_directory: str = Field(
        default="",
        description="Where the compressed model is published. Empty: a folder named "
        "MODEL-SCHEME under $COMPRESSFLOW_OUTPUT_DIR (or ./outputs).",
    )
    # Tags go to the Prefect server, ClearML and the manifest of every run: bounded, one line each.
    tags: list[Annotated[str, Field(min_length=1, max_length=100, pattern=TAG)]] = Field(
        default_factory=list,
        max_length=50,
        description="Tags for the Prefect run, ClearML and the manifest (the scheme is added): "
        "at most 50, each one line of at most 100 characters.",
    )
    save_compressed: bool = Field(
        default=True, description="Save in compressed-tensors format (what vLLM serves)."
    )
    overwrite: bool = Field(
        default=False,
        description="Replace an earlier compressflow output at save_directory: only the files its "
        "manifest lists are deleted, and a folder holding anything else is refused.",
    )
    upload_uri: str = Field(
        default="",
        # The schemes in the deployment's schema too: the form refuses another before a run.
        pattern=r"^((s3|file)://\S+)?$",
        description="Where the published model is uploaded once verified, as the exact prefix "
        "its files go to: s3://BUCKET/PREFIX (AWS, or an S3-compatible store such as MinIO, "
        "Ceph or R2) or file:///ABSOLUTE/PATH. The manifest is written last, so a reader never "
        "sees half a model; a rerun of the same inputs reuses it from there, even on a worker "
        "without the local copy. Credentials never go here: they come from the AwsCredentials "
        "block named in upload_credentials, or else the worker's AWS_* environment. Empty: "
        "the model stays in save_directory only.",
    )
    upload_credentials: str = Field(
        default="",
        pattern=BLOCK_NAME_OR_EMPTY,
        description="Name of a prefect-aws AwsCredentials block holding the keys (and, for an "
        "S3-compatible store, the endpoint) for upload_uri: the name, never a key. Empty: "
        "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT_URL from the worker's "
        "environment.",
    )
    auto_evaluate: bool = Field(
        default=True,
        description="Let the evaluate-model deployment's trigger evaluate this output (its "
        "published event says so); sweeps turn it off and evaluate their points themselves.",
    )

    @field_validator("tags", mode="before")
    @classmethod
    def _one_line_each(cls, tags: Any) -> Any:
        # Before the pattern, whose own message shows a regex instead of the problem.
        for number, tag in enumerate(tags if isinstance(tags, list) else []):
            if isinstance(tag, str) and re.search(r"[\x00-\x1f\x7f]", tag):
                raise InputError(
                    "output.tags",
                    f"tag {number + 1}, {tag[:40]!r}, holds a newline or another control character",
                    "write each tag as one line of plain text",
                )
        return tags

    @field_validator("upload_uri", mode="before")
    @classmethod
    def _a_prefix(cls, uri: Any) -> Any:
        # Refused in the form and in `validate`, before anything runs; kept normalised
        # (s3://bucket/prefix, no trailing slash) so the URI a run records is one spelling.
        if isinstance(uri, str) and uri:
            location = parse_upload_uri(uri, "output.upload_uri")
            if location.scheme == "file":  # still a URI: a space in a folder's name stays %20
                return "file://" + quote(location.prefix)
            return location.uri
        return uri

    @field_validator("upload_credentials", mode="before")
    @classmethod
    def _a_name_not_a_key(cls, value: Any) -> Any:
        return block_name(value, "output.upload_credentials")  # before the pattern, which echoes
