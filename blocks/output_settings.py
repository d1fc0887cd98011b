"""OutputSettings: where compressed models are published, shared by every deployment.

Deployments read it when they are deployed (`prefect.yaml` puts `output_dir` into the job's
COMPRESSFLOW_OUTPUT_DIR), so one block decides the default `save_directory` root for every worker.
Point it at storage every GPU host mounts at the same path (e.g. an NFS share): the evaluation
run that follows a compression may land on another host.
"""

from __future__ import annotations

from prefect.blocks.core import Block
from pydantic import Field


class OutputSettings(Block):
    """The folder under which compress-model publishes `<model>-<scheme>` outputs."""

    _block_type_name = "Compressflow Output Settings"
    _description = (
        "Where compressflow publishes compressed models when a run names no save_directory."
    )

    output_dir: str = Field(
        description="Absolute folder, mounted at the same path on every worker host, that receives "
        "<model>-<scheme>/ outputs."
    )
