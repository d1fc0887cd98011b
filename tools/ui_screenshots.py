"""Screenshots of what a person sees in the Prefect UI, for the docs: `make screenshots`.

Starts the end-to-end stack the tests use (a real `prefect server`, the README's deploy commands,
a worker), runs the `compress` deployment on the demo's learned-weights model (the yardstick,
shared with `make demo` under .demo/, so its figures are real), and photographs with Debian's
headless `chromium` (no driver, no Python browser package): the Custom run form, the finished
run's page, its summary, verification and trade-off artifacts (with vLLM's verdict when `make
vllm-env` built vLLM; the run has a 4.5-bit budget), the Artifacts page, and evaluate-model's run
form. The PNGs land in docs/screenshots/.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the end-to-end stack lives with the tests

from support.prefect_stack import running_stack, wait_final  # noqa: E402

OUT = ROOT / "docs" / "screenshots"


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    raise SystemExit("no chromium on PATH: apt-get install chromium")


def shoot(url: str, path: Path, height: int = 1600) -> None:
    """One page, after its scripts have run (virtual time lets the UI fetch and render)."""
    subprocess.run(
        [
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--window-size=1440,{height}",
            "--virtual-time-budget=20000",
            f"--screenshot={path}",
            url,
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    print(f"{path.relative_to(ROOT)}: {url}")


def main() -> None:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from compressflow.demo.yardstick import build_yardstick

    OUT.mkdir(parents=True, exist_ok=True)
    yardstick = build_yardstick(ROOT / ".demo" / "yardstick")
    with tempfile.TemporaryDirectory(prefix="compressflow-ui-") as tmp:
        with running_stack(Path(tmp) / "stack") as stack:
            ui = stack.api_url.removesuffix("/api")
            with (
                temporary_settings({PREFECT_API_URL: stack.api_url}),
                get_client(sync_client=True) as client,
            ):
                deployment = client.read_deployment_by_name("compress-model/compress")
                shoot(
                    f"{ui}/deployments/deployment/{deployment.id}/run", OUT / "run-form.png", 8200
                )
                evaluation = client.read_deployment_by_name("evaluate-model/evaluate")
                shoot(
                    f"{ui}/deployments/deployment/{evaluation.id}/run",
                    OUT / "evaluate-form.png",
                    3900,
                )
                run = client.create_flow_run_from_deployment(
                    deployment.id,
                    parameters={
                        "model": {"model_id": str(yardstick.model.resolve())},
                        "dataset": {
                            "dataset_name": str(yardstick.calibration.resolve()),
                            "text_samples": 128,
                            "max_seq_len": yardstick.spec.seq_len,
                        },
                        "recipe": {"preset": "W4A16"},
                        "output": {"tags": ["demo"]},
                        # A bits budget: the run also shows the trade-off it chose from.
                        "target": {
                            "avg_bits": 4.5,
                            "held_out": {
                                "dataset_name": str(yardstick.held_out.resolve()),
                                "samples": 64,
                                "max_seq_len": yardstick.spec.seq_len,
                            },
                        },
                    },
                )
                final = wait_final(client, stack, run.id, timeout=600)
                if not final.state.is_completed():
                    raise SystemExit(
                        f"the demo run ended {final.state.name}: {final.state.message}"
                    )
                time.sleep(2)  # the artifacts are written by the worker's run: let them land
                shoot(f"{ui}/runs/flow-run/{run.id}", OUT / "run.png", 1100)
                shoot(f"{ui}/artifacts", OUT / "artifacts-page.png", 900)
                for kind in ("summary", "verification", "tradeoff"):
                    found = next(
                        a
                        for a in client.read_artifacts()
                        if a.key and a.key.endswith(f"-{kind}") and a.flow_run_id == run.id
                    )
                    shoot(f"{ui}/artifacts/artifact/{found.id}", OUT / f"{kind}-artifact.png", 1400)


if __name__ == "__main__":
    os.environ.setdefault("CLEARML_OFFLINE_MODE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
