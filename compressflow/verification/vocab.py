"""Check: the output's tokenizer fits its saved embedding, as the source's had to at fetch.

The same contract as the folder check (compressflow/model/folder_checks/vocab.py): every id the
saved tokenizer can produce is a row of the saved input embedding (and output head), read from the
output's own safetensors headers, and no added token takes an id of the vocabulary's. A tokenizer
saved beside weights it does not fit is published only to fail at a server's first request for
the token.
"""

from __future__ import annotations

import json
from pathlib import Path

from compressflow.model.folder_checks.vocab import FIX, fit
from compressflow.results import VerificationCheck
from compressflow.verification import Check


def check_tokenizer_fit(staging: Path) -> VerificationCheck:
    config = json.loads((staging / "config.json").read_text())
    found = fit(staging, config if isinstance(config, dict) else {}, headers=True)
    return VerificationCheck(
        name=CHECK.name, passed=found.problem is None, detail=found.problem or found.detail
    )


CHECK = Check(
    name="tokenizer fits",
    field="model.model_id",
    fix=FIX,
    function=lambda state: check_tokenizer_fit(state.staging),
)
