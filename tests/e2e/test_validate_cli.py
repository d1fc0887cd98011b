"""`validate` from the CLI in a process of its own, as a user starts it: quiet, and the flow's
process stays light (no torch, no model libraries). The checks themselves:
tests/unit/test_validate.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from support.parameters import params

# What the flow's own process must never import: they live in its child processes (in_child).
HEAVY = ("torch", "transformers", "llmcompressor", "datasets", "compressed_tensors")


def test_cli_is_quiet_and_leaves_the_flows_process_light(models, tmp_path):
    """What a user sees, in a process of its own: the checks' table and the output folder. And
    every pre-calibration check (render, fetch, dataset, plan, trace) answers without that
    process importing torch or the model libraries: a worker's flow process stays small."""
    file = tmp_path / "params.yaml"
    file.write_text(json.dumps(params(models, tmp_path)))
    imported = tmp_path / "imported.json"
    # `python -m compressflow.flows.cli validate FILE`, then what it imported, written at exit.
    script = (
        "import atexit, json, runpy, sys; out = sys.argv.pop(); atexit.register(lambda: "
        f"open(out, 'w').write(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))); "
        "runpy.run_module('compressflow.flows.cli', run_name='__main__')"
    )
    run = subprocess.run(
        [sys.executable, "-c", script, "validate", str(file), str(imported)],
        capture_output=True,
        text=True,
        env=os.environ.copy(),
    )
    assert run.returncode == 0, run.stderr
    for noise in ("Warning", "WARNING", "it/s", "█", "%|"):
        assert noise not in run.stdout + run.stderr
    assert run.stderr == ""
    lines = run.stdout.splitlines()
    assert lines[0] == "Parameters are valid:"
    assert all(line.startswith("  ") for line in lines[1:-1])
    assert lines[-1] == f"Output: {tmp_path / 'out'}"
    assert json.loads(imported.read_text()) == []
