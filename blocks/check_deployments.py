"""Refuse to deploy while a deployment names a block that the Prefect server does not have.

A missing block otherwise surfaces only when a run starts, minutes or a nightly later, while the
deployment shows "Ready". prefect.yaml runs this as a build step, so `prefect deploy` stops with
the fix; by hand: `python -m compressflow.blocks.check_deployments [prefect.yaml]`. It prints
nothing when every block exists, and one line per missing block (exit status 1) otherwise.

A block is referenced by a `hub_token_block` (Secret) or `clearml_block` (ClearML Settings)
parameter, at any depth (`model`, `base`, ...), or by a `{{ prefect.blocks.<type>.<name> }}`
template anywhere in the deployment. Every deployment in the file is checked, whichever is being
deployed: prefect.yaml is deployed as one.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from prefect.client.orchestration import get_client
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_URL

from compressflow.blocks.clearml_settings import ClearMLSettings
from compressflow.blocks.output_settings import OutputSettings
from compressflow.blocks.register import CLEARML_BLOCK, HUB_TOKEN_BLOCK, OUTPUT_BLOCK

SECRET = "secret"
CLEARML = ClearMLSettings.get_block_type_slug()
OUTPUT = OutputSettings.get_block_type_slug()
TYPE_NAMES = {
    SECRET: "Secret",
    CLEARML: ClearMLSettings.get_block_type_name(),
    OUTPUT: OutputSettings.get_block_type_name(),
}
# Parameters that hold a block's name, by the type of block they name.
NAME_PARAMETERS = {"hub_token_block": SECRET, "clearml_block": CLEARML}
TEMPLATE = re.compile(r"\{\{\s*prefect\.blocks\.([^.\s}]+)\.([^.\s}]+)")
REGISTER = "python -m compressflow.blocks.register"
# What `register` saves, and from what; any other block is made by hand.
REGISTERED = {
    (SECRET, HUB_TOKEN_BLOCK): f"HF_TOKEN=... {REGISTER}",
    (CLEARML, CLEARML_BLOCK): "CLEARML_API_HOST=... CLEARML_API_ACCESS_KEY=... "
    f"CLEARML_API_SECRET_KEY=... {REGISTER}",
    (OUTPUT, OUTPUT_BLOCK): f"{REGISTER} (--output-dir DIR)",
}


@dataclass(frozen=True)
class Reference:
    deployment: str
    where: str  # `parameter model.hub_token_block`, `work_pool.job_variables.env.X`
    block_type: str  # the type's slug
    name: str

    def missing(self, api_url: str) -> str:
        """The message for this block not existing on `api_url`, with the fix."""
        type_name = TYPE_NAMES.get(self.block_type, self.block_type)
        create = REGISTERED.get(
            (self.block_type, self.name),
            f"create a {type_name} block named {self.name!r} (UI: Blocks > +)",
        )
        return (
            f"deployment {self.deployment}: {self.where} names {type_name} block "
            f"{self.name!r}, which does not exist on {api_url}. Fix: {create}, or remove the "
            f"{'parameter' if self.where.startswith('parameter') else 'reference'}"
        )


def walk(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every (dotted path, leaf value) in nested dicts and lists."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from walk(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from walk(item, f"{path}[{index}]")
    else:
        yield path, value


def references(config: dict) -> list[Reference]:
    """The blocks each deployment of a parsed prefect.yaml names."""
    found = []
    for deployment in config.get("deployments") or []:
        name = deployment.get("name", "?")
        for path, value in walk(deployment.get("parameters") or {}):
            block_type = NAME_PARAMETERS.get(path.rsplit(".", 1)[-1])
            if block_type and isinstance(value, str) and value:  # "": no block, HF_TOKEN etc.
                found.append(Reference(name, f"parameter {path}", block_type, value))
        for path, value in walk(deployment):
            if isinstance(value, str):
                where = path
                if path.startswith("parameters."):
                    where = f"parameter {path.removeprefix('parameters.')}"
                for block_type, block_name in TEMPLATE.findall(value):
                    found.append(Reference(name, where, block_type, block_name))
    return found


def missing_blocks(prefect_file: Path) -> list[str]:
    """One message per block a deployment in `prefect_file` names that the server lacks."""
    found = references(yaml.safe_load(prefect_file.read_text()) or {})
    api_url = PREFECT_API_URL.value() or "the Prefect API"
    problems, exists = [], {}
    with get_client(sync_client=True) as client:
        for reference in found:
            key = (reference.block_type, reference.name)
            if key not in exists:
                try:
                    client.read_block_document_by_name(
                        reference.name, reference.block_type, include_secrets=False
                    )
                    exists[key] = True
                except ObjectNotFound:
                    exists[key] = False
            if not exists[key]:
                problems.append(reference.missing(api_url))
    return problems


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m compressflow.blocks.check_deployments", description=__doc__.split("\n")[0]
    )
    parser.add_argument("prefect_file", nargs="?", default="prefect.yaml", type=Path)
    problems = missing_blocks(parser.parse_args(argv).prefect_file)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        sys.exit(1)


if __name__ == "__main__":
    main()
