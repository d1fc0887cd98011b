"""The folder checks by name, in the order they run, and `check_folder`, which runs them."""

from __future__ import annotations

from pathlib import Path

from compressflow.model.folder_checks import Folder, FolderCheck, config, files, tokenizer, vocab
from compressflow.model.folder_checks import weights as weight_files
from compressflow.params import ModelArgs

# Cheapest first: the folder and the files the loaders open readable, every JSON file and chat
# template parsed, what loading could execute (auto_map, pickle weights), the tokenizer there,
# the safetensors headers whole and the config's sizes against them, the tokenizer's ids against
# the embedding's rows.
FOLDER_CHECKS: tuple[FolderCheck, ...] = (
    files.READABLE,
    files.FILES,
    config.CONFIG,
    files.JSON,
    tokenizer.REMOTE_CODE,
    tokenizer.TEMPLATES,
    tokenizer.TOKENIZER,
    weight_files.PICKLES,
    weight_files.WEIGHT_FILES,
    config.SIZES,  # against the layers the weight files hold
    vocab.VOCAB,  # the tokenizer's ids against the embedding's rows, from the headers
)


def check_folder(
    path: Path, args: ModelArgs, weights: bool = True, quantized: bool = False
) -> dict:
    """Every check of a model folder that needs no library, in FOLDER_CHECKS' order. Returns
    config.json's settings.

    `weights=False`: a hub model fetched without its weight files (validation), whose index
    names shards not downloaded: the weight files' checks wait for the run, which fetches them.
    `quantized`: a compressed model, as evaluate-model reads one."""
    folder = Folder(path, args, quantized)
    for check in FOLDER_CHECKS:
        if weights or not check.weights:
            check.function(folder)
    return folder.config
