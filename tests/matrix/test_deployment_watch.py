"""`prefect deployment run --watch`, as a user runs it against the session's stack
(tests/support/prefect_stack.py): a run the schema accepts but the flow refuses shows why it
failed, and the fix. A worker run each (~25 s).
"""

from __future__ import annotations

import json

import pytest
from support.prefect_stack import cli


@pytest.mark.parametrize(
    ("model", "problem"),
    [
        (
            {"model_id": "/nonexistent/model"},
            "model.model_id: local folder /nonexistent/model does not exist. Fix:",
        ),
        (
            {"model_id": "acme/tiny-llama", "hub_token_block": "no-such-token"},
            "model.hub_token_block: no Secret block named 'no-such-token' on",
        ),
    ],
    ids=["missing-folder", "missing-token-block"],
)
def test_watch_shows_why_a_run_failed(stack, model, problem):
    """A run the schema accepts but the flow refuses, run and watched from the CLI."""
    done = cli(
        stack,
        ".venv/bin/prefect",
        "deployment",
        "run",
        "compress-model/compress",
        "--watch",
        "--param",
        f"model={json.dumps(model)}",
    )
    output = " ".join((done.stdout + done.stderr).split())  # rich wraps long lines
    assert done.returncode != 0, output
    assert problem in output, output + "\n" + stack.tail("worker-gpu")
    assert "Fix:" in output.split(problem, 1)[1]
