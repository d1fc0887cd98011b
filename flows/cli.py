"""The `compressflow` command: checks parameters before they reach a GPU.

    compressflow validate params.yaml            # a file with model/dataset/recipe/output keys
    compressflow validate --deployment NAME      # a deployment's parameters from prefect.yaml

Exit status: 0 when valid, 2 with the error (field, problem, fix) when not.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml
from pydantic import ValidationError

from compressflow.errors import CompressflowError


def deployment_parameters(prefect_yaml: Path, name: str) -> dict:
    deployments = yaml.safe_load(prefect_yaml.read_text()).get("deployments") or []
    for deployment in deployments:
        if deployment.get("name") == name:
            return deployment.get("parameters") or {}
    names = ", ".join(d.get("name", "?") for d in deployments) or "none"
    raise SystemExit(f"{prefect_yaml} has no deployment {name!r} (it has: {names})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compressflow", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("validate", help="run every pre-calibration check")
    source = check.add_mutually_exclusive_group(required=True)
    source.add_argument("params", nargs="?", type=Path, help="YAML or JSON parameters file")
    source.add_argument("--deployment", help="name of a deployment in prefect.yaml")
    check.add_argument("--prefect-yaml", type=Path, default=Path("prefect.yaml"))
    options = parser.parse_args(argv)

    if options.deployment:
        params = deployment_parameters(options.prefect_yaml, options.deployment)
    else:
        params = yaml.safe_load(options.params.read_text()) or {}
    groups = {"model", "dataset", "recipe", "output", "calibration", "tracking", "verify"}
    unknown = set(params) - groups
    if unknown or "model" not in params:
        print(
            f"error: parameters need a 'model' group; unknown groups: {sorted(unknown)}",
            file=sys.stderr,
        )
        return 2

    from compressflow.flows.validate import validate

    params.pop("tracking", None)  # nothing to check without a run
    params.pop("verify", None)  # its thresholds apply to a calibrated model
    try:
        report = validate(**params)
    except (CompressflowError, ValidationError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report.table())
    print(
        f"Output: {report.output_path}"
        + (" (already published: a run would reuse it)" if report.reuses_output else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
