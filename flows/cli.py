"""The `compressflow` command: checks parameters before they reach a GPU.

    compressflow validate params.yaml            # a file with model/dataset/recipe/output keys
    compressflow validate --deployment NAME      # a deployment's parameters from prefect.yaml

Exit status: 0 when valid, 2 when not, with each problem on a line of its own as
`<field>: <problem>. Fix: <fix>`. Every group's shape errors come together; after them, the
checks stop at their first problem, as the flow does.
"""

from __future__ import annotations

import argparse
import difflib
import io
import logging
import os
import reprlib
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from compressflow.errors import CompressflowError, InputError
from compressflow.limits import load_yaml, read_text

EPILOG = """\
examples:
  compressflow validate params.yaml
  compressflow validate --deployment nightly-w4a16
  compressflow validate --deployment w8a8 --prefect-yaml path/to/prefect.yaml

params.yaml (or .json) holds the parameter groups of a compress-model run; model is required,
the other groups have defaults:

  model: {model_id: meta-llama/Llama-3.2-1B-Instruct}
  dataset: {dataset_name: ultrachat_200k, text_samples: 512, max_seq_len: 2048}
  recipe: {preset: W4A16, recipe_args: {dampening_frac: 0.01}}
  output: {save_directory: ./outputs/llama-w4a16}

exit status:
  0  valid: prints each check's result and the output folder
  2  invalid: prints each problem to stderr as `error: <field>: <problem>. Fix: <fix>`
"""


@contextmanager
def quiet() -> Iterator[None]:
    """Send what the checks' libraries print (warnings, log lines, progress bars) to /dev/null;
    compressflow's own warnings are printed after them.

    At the file descriptors, since no library switch reaches it all: compressed-tensors draws its
    bar with disable=False whatever TQDM_DISABLE says, torch's C++ warnings bypass Python, and
    log handlers keep the stream they were given (llm-compressor's writes to stdout).
    """
    noted = io.StringIO()
    own = logging.StreamHandler(noted)
    own.setLevel(logging.WARNING)
    own.setFormatter(logging.Formatter("warning: %(message)s"))
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    with open(os.devnull, "w") as devnull:
        for fd in saved:
            os.dup2(devnull.fileno(), fd)
        logging.getLogger("compressflow").addHandler(own)
        try:
            yield
        finally:
            logging.getLogger("compressflow").removeHandler(own)
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
            sys.stderr.write(noted.getvalue())


def read_yaml(path: Path, option: str) -> dict[str, Any]:
    """The mapping a YAML (or JSON) file holds; InputError naming the option when there is none."""
    try:
        content = load_yaml(read_text(path, str(path), option), str(path), option)
    except (OSError, yaml.YAMLError) as exc:
        problem = " ".join(f"cannot read {path}: {exc}".split())  # YAML's message spans lines
        raise InputError(option, problem, "give a readable YAML or JSON file") from exc
    if content is not None and not isinstance(content, dict):
        raise InputError(
            option,
            f"{path} holds a {type(content).__name__}, not parameter groups",
            "write one `group: {field: value, ...}` line per group",
        )
    return content or {}


def deployment_parameters(prefect_yaml: Path, name: str) -> dict[str, Any]:
    """The parameters a compress-model deployment sets; InputError when it sets none to check."""
    from compressflow.flows.compress import compress

    deployments = {
        str(d.get("name")): d
        for d in read_yaml(prefect_yaml, "--prefect-yaml").get("deployments") or []
    }
    ours = [
        n
        for n, d in deployments.items()
        if str(d.get("entrypoint")).endswith(f":{compress.fn.__name__}")
    ]
    if name not in deployments:
        close = difflib.get_close_matches(name, deployments, n=1)
        raise InputError(
            "--deployment",
            f"{prefect_yaml} has no deployment {name!r} (it has: {', '.join(deployments) or 'none'})",
            f"did you mean {close[0]}?" if close else "use one of those, or --prefect-yaml",
        )
    if name not in ours:
        raise InputError(
            "--deployment",
            f"deployment {name!r} runs {deployments[name].get('entrypoint')}, not {compress.name}",
            f"validate a {compress.name} deployment: {', '.join(ours)}",
        )
    params = deployments[name].get("parameters") or {}
    if "model" not in params:
        raise InputError(
            "model",
            f"deployment {name!r} sets no model: its parameters come from the run",
            "put them in a file and run `compressflow validate params.yaml`",
        )
    return params


def explain(error: ErrorDetails, groups: dict[str, type[BaseModel]]) -> InputError:
    """One pydantic error as `<field>: <problem>. Fix: <fix>`."""
    loc = error["loc"]
    field = ".".join(map(str, loc))
    if error["type"] == "missing":
        return InputError(field, error["msg"], "add it")
    if isinstance(own := error.get("ctx", {}).get("error"), InputError):
        # Our validators' refusals read as written, and show only what they chose to show: a
        # `*_block` field's value may be a pasted secret.
        return own
    if error["type"] == "extra_forbidden":
        if len(loc) == 1:
            names, problem, known = list(groups), "not a parameter group", "the groups are"
        else:
            group = str(loc[0])
            names = list(groups[group].model_fields)
            problem, known = f"not a field of {group}", f"{group}'s fields are"
        close = difflib.get_close_matches(str(loc[-1]), names, n=1)
        hint = f"did you mean {close[0]}?" if close else "remove it;"
        return InputError(field, problem, f"{hint} {known}: {', '.join(names)}")
    return InputError(
        field,
        f"{error['msg']}, got {reprlib.repr(error['input'])}",
        "give a value that satisfies this",
    )


def refuse(problems: Iterable[CompressflowError]) -> int:
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="compressflow",
        description=__doc__.splitlines()[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser(
        "validate",
        help="run every pre-calibration check",
        description="Run every check compress-model makes before calibrating, without weights.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = check.add_mutually_exclusive_group(required=True)
    source.add_argument("params", nargs="?", type=Path, help="YAML or JSON parameters file")
    source.add_argument("--deployment", help="name of a deployment in prefect.yaml")
    check.add_argument("--prefect-yaml", type=Path, default=Path("prefect.yaml"))
    check.add_argument(
        "--verbose",
        action="store_true",
        help="show the libraries' warnings, log lines and progress bars",
    )
    commands.add_parser(
        "presets",
        help="list the recipe presets: what each does, its data, where vLLM runs it",
        description="The presets recipe.preset accepts, with their recipe_args defaults.",
    )
    return parser


def list_presets() -> int:
    from compressflow.registries.presets import preset_rows

    for row in preset_rows():
        print(f"{row['preset']}: {row['what']}")
        for label, key in (
            ("data", "data"),
            ("vLLM runs it on", "vllm_gpus"),
            ("CPU worker here", "cpu_worker"),
            ("recipe_args", "placeholders"),
        ):
            print(f"    {label}: {row[key] or 'none'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    options = build_parser().parse_args(argv)
    if options.command == "presets":
        return list_presets()
    # After parsing, so that --help answers at once.
    from compressflow.flows.validate import FLOW_GROUPS, Parameters, validate

    try:
        if options.deployment:
            params = deployment_parameters(options.prefect_yaml, options.deployment)
        else:
            params = read_yaml(options.params, "params")
        # tracking, verify: nothing to run without a calibrated model, but their shape is checked.
        run_only = {
            name: params.pop(name)
            for name in FLOW_GROUPS.keys() - Parameters.model_fields
            if name in params
        }
    except InputError as exc:
        return refuse([exc])
    errors = []
    for name, values in run_only.items():
        try:
            FLOW_GROUPS[name].model_validate(values)
        except ValidationError as exc:
            errors += [{**error, "loc": (name, *error["loc"])} for error in exc.errors()]
    try:
        groups = Parameters.model_validate(params)
    except ValidationError as exc:
        errors = [*exc.errors(), *errors]
    if errors:
        return refuse(explain(error, FLOW_GROUPS) for error in errors)

    try:
        with nullcontext() if options.verbose else quiet():
            report = validate(**dict(groups))
    except CompressflowError as exc:
        return refuse([exc])
    print(report.table())
    print(
        f"Output: {report.output_path}"
        + (" (already published: a run would reuse it)" if report.reuses_output else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
