"""The verify checks by name, in the order they run (run.run_checks): each entry says which
parameter a failure points at and the fix the stage's VerificationError gives."""

from __future__ import annotations

from compressflow.verification import Check, config, logits, names, reload, vllm, vocab, weights

CHECKS: dict[str, Check] = {
    check.name: check
    for check in (
        config.CHECK,
        vocab.CHECK,  # the saved tokenizer against the saved embedding's rows
        names.CHECK,
        weights.CHECK,  # model-free runs only, from the one pass
        reload.CHECK,
        logits.CHECK,
        vllm.CHECK,  # the slowest: only when all the others passed
    )
}
