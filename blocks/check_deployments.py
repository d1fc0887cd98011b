"""Refuse to deploy while a deployment names a block that the Prefect server does not have.

A missing block otherwise surfaces only when a run starts, minutes or a nightly later, while the
deployment shows "Ready". prefect.yaml runs this as a build step, so `prefect deploy` stops with
the fix; by hand: `python -m compressflow.blocks.check_deployments [prefect.yaml]`. It prints
nothing when every block exists, and one line per missing block (exit status 1) otherwise.

A block is referenced by a `hub_token_block` (Secret) or `clearml_block` (ClearML Settings)
parameter, at any depth (`model`, `base`, ...), or by a `{{ prefect.blocks.<type>.<name> }}`
template anywhere in the deployment. Every deployment in the file is checked, whichever is being
deployed: prefect.yaml is deployed as one. A key written twice in one mapping (a deployment's
parameters above all) stops the deploy too: Prefect's YAML parser would silently keep the second.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compressflow.errors import InputError
from compressflow.limits import load_yaml, read_text

SECRET = "secret"
TEMPLATE = re.compile(r"\{\{\s*prefect\.blocks\.([^.\s}]+)\.([^.\s}]+)")
REGISTER = "python -m compressflow.blocks.register"
# `prefect deploy --all` runs the build step once per deployment, and each run checks every
# deployment of the file: with --once-per-deploy, the first run of a deploy leaves a mark, the
# others find it (for this long at most) and exit before importing Prefect. Six runs took 12 of
# a deploy's 16 s.
MARK_SECONDS = 600
MARK_PREFIX = "compressflow-blocks-checked-"


@dataclass(frozen=True)
class BlockTypes:
    """The block vocabulary, from the block classes (importing them imports Prefect)."""

    name_parameters: dict[str, str]  # parameters that hold a block's name -> the type's slug
    type_names: dict[str, str]  # slug -> the type's display name
    registered: dict[tuple[str, str], str]  # what `register` saves, and from what


@functools.cache
def block_types() -> BlockTypes:
    from compressflow.blocks.clearml_settings import ClearMLSettings
    from compressflow.blocks.output_settings import OutputSettings
    from compressflow.blocks.register import CLEARML_BLOCK, HUB_TOKEN_BLOCK, OUTPUT_BLOCK

    clearml, output = ClearMLSettings.get_block_type_slug(), OutputSettings.get_block_type_slug()
    return BlockTypes(
        name_parameters={"hub_token_block": SECRET, "clearml_block": clearml},
        type_names={
            SECRET: "Secret",
            clearml: ClearMLSettings.get_block_type_name(),
            output: OutputSettings.get_block_type_name(),
        },
        registered={
            (SECRET, HUB_TOKEN_BLOCK): f"HF_TOKEN=... {REGISTER}",
            (clearml, CLEARML_BLOCK): "CLEARML_API_HOST=... CLEARML_API_ACCESS_KEY=... "
            f"CLEARML_API_SECRET_KEY=... {REGISTER}",
            (output, OUTPUT_BLOCK): f"{REGISTER} (--output-dir DIR)",
        },
    )


@dataclass(frozen=True)
class Reference:
    deployment: str
    where: str  # `parameter model.hub_token_block`, `work_pool.job_variables.env.X`
    block_type: str  # the type's slug
    name: str

    def missing(self, api_url: str) -> str:
        """The message for this block not existing on `api_url`, with the fix."""
        types = block_types()
        type_name = types.type_names.get(self.block_type, self.block_type)
        create = types.registered.get(
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
            block_type = block_types().name_parameters.get(path.rsplit(".", 1)[-1])
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


def read_prefect_file(prefect_file: Path) -> dict:
    """prefect.yaml parsed as `compressflow validate --deployment` reads it: bounded, and a key
    written twice refused (InputError) where Prefect would keep the second silently."""
    where, field = str(prefect_file), "prefect_file"
    return load_yaml(read_text(prefect_file, where, field), where, field) or {}


def missing_blocks(prefect_file: Path) -> list[str]:
    """One message per block a deployment in `prefect_file` names that the server lacks."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL

    found = references(read_prefect_file(prefect_file))
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
    parser.add_argument(
        "--once-per-deploy",
        action="store_true",
        help="as prefect.yaml's build step: skip when the deploy that runs it (the parent "
        "process) has checked the same file already",
    )
    options = parser.parse_args(argv)
    mark = deploy_mark(options.prefect_file) if options.once_per_deploy else None
    if mark and mark.exists() and time.time() - mark.stat().st_mtime < MARK_SECONDS:
        return
    try:
        problems = missing_blocks(options.prefect_file)
    except InputError as exc:  # prefect.yaml itself: a key written twice, or past the limits
        problems = [str(exc)]
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        sys.exit(1)
    if mark:
        for stale in mark.parent.glob(f"{MARK_PREFIX}*"):  # earlier deploys' marks
            with contextlib.suppress(FileNotFoundError):  # another deploy removed it first
                if time.time() - stale.stat().st_mtime >= MARK_SECONDS:
                    stale.unlink()
        mark.touch()


def deploy_mark(prefect_file: Path) -> Path:
    """Where a deploy (the process that runs this as a build step: our parent) marks the file
    as checked, with its text: an edit, or another deploy, checks again."""
    digest = hashlib.sha256(prefect_file.read_bytes()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"{MARK_PREFIX}{os.getppid()}-{digest}"


if __name__ == "__main__":
    main()
