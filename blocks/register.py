"""Register compressflow's block types and save its blocks: `python -m compressflow.blocks.register`.

One command for a new Prefect server (or workspace), safe to rerun: each block is created or
updated in place. Values come from flags, else from the environment, and secrets are never printed:

- `Compressflow Output Settings` block `compressflow`: `--output-dir`, else
  $COMPRESSFLOW_OUTPUT_DIR, else ./outputs (made absolute). prefect.yaml reads it at deploy time:
  register before deploying.
- `ClearML Settings` block `clearml`: only when an API host and both keys are given
  (`--clearml-api-host` or $CLEARML_API_HOST, $CLEARML_API_ACCESS_KEY, $CLEARML_API_SECRET_KEY).
  Runs use it when `tracking.clearml_block` names it.
- `Secret` block `hf-token`: only when $HF_TOKEN is set (a flag would leave the token in shell
  history). Runs use it when `model.hub_token_block` names it.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from prefect.blocks.system import Secret

from compressflow.blocks.clearml_settings import ClearMLSettings
from compressflow.blocks.output_settings import OutputSettings

OUTPUT_BLOCK = "compressflow"
CLEARML_BLOCK = "clearml"
HUB_TOKEN_BLOCK = "hf-token"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(
        prog="python -m compressflow.blocks.register", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--output-dir",
        default=env("COMPRESSFLOW_OUTPUT_DIR", "outputs"),
        help="Folder that receives published models (default: "
        "$COMPRESSFLOW_OUTPUT_DIR or ./outputs).",
    )
    parser.add_argument("--clearml-api-host", default=env("CLEARML_API_HOST"))
    parser.add_argument("--clearml-web-host", default=env("CLEARML_WEB_HOST"))
    parser.add_argument("--clearml-files-host", default=env("CLEARML_FILES_HOST"))
    parser.add_argument(
        "--clearml-project",
        default="compressflow",
        help="Default ClearML project of runs that name none.",
    )
    parser.add_argument(
        "--clearml-output-uri",
        default=None,
        help="Where ClearML stores uploaded models (e.g. s3://bucket/path).",
    )
    return parser.parse_args(argv)


def register(args: argparse.Namespace) -> list[str]:
    """Register the block types, save the blocks the values allow; one line per action."""
    done = []
    for block_class in (OutputSettings, ClearMLSettings):
        block_class.register_type_and_schema()
        done.append(f"registered block type {block_class.get_block_type_name()!r}")

    output_dir = str(Path(args.output_dir).expanduser().resolve())
    OutputSettings(output_dir=output_dir).save(OUTPUT_BLOCK, overwrite=True)
    done.append(
        f"saved {OutputSettings.get_block_type_slug()}/{OUTPUT_BLOCK}: output_dir={output_dir}"
    )

    access_key, secret_key = (
        os.environ.get("CLEARML_API_ACCESS_KEY"),
        os.environ.get("CLEARML_API_SECRET_KEY"),
    )
    if args.clearml_api_host and access_key and secret_key:
        ClearMLSettings(
            api_host=args.clearml_api_host,
            web_host=args.clearml_web_host,
            files_host=args.clearml_files_host,
            access_key=access_key,
            secret_key=secret_key,
            default_project=args.clearml_project,
            output_uri=args.clearml_output_uri,
        ).save(CLEARML_BLOCK, overwrite=True)
        slug = ClearMLSettings.get_block_type_slug()
        done.append(f"saved {slug}/{CLEARML_BLOCK}: {args.clearml_api_host}")
    elif args.clearml_api_host or access_key or secret_key:
        done.append(
            "skipped ClearML Settings: it needs an API host, CLEARML_API_ACCESS_KEY and "
            "CLEARML_API_SECRET_KEY together"
        )
    else:
        done.append("skipped ClearML Settings: no server given (runs log offline)")

    if token := os.environ.get("HF_TOKEN"):
        Secret(value=token).save(HUB_TOKEN_BLOCK, overwrite=True)
        done.append(f"saved secret/{HUB_TOKEN_BLOCK} from HF_TOKEN")
    else:
        done.append("skipped the hub token Secret: HF_TOKEN is not set")
    return done


def main(argv: list[str] | None = None) -> None:
    for line in register(parse_args(argv)):
        print(line)


if __name__ == "__main__":
    main()
