"""The folder checks: whether a model folder is sound before anything loads it.

Cheap checks that would otherwise fail after minutes of loading run here, before weights load:
a config.json that is missing or not a JSON object, or whose sizes no model has, a model that
needs `trust_remote_code` or is already quantized, a folder without a tokenizer, truncated or
malformed safetensors, a FIFO, device or folder where a model file should be, or one this worker
cannot read, a JSON file that does not parse, a chat template jinja2 cannot parse, a tokenizer
or processor that would import the repository's own code, and weights held only as pickle files
(torch.load can execute what they carry), and a tokenizer with ids the embedding has no rows
for. `registry.check_folder` runs every one of them (none needs a library: torch and
transformers stay unimported), in the flow's own process: on a local folder before any child
starts, on a download after it.

Each check is a `FolderCheck` in the module of its subject (files.py, config.py, tokenizer.py,
vocab.py, weights.py): its name, the field a failure blames, and its function, which takes the
`Folder` under check (the folder, the model's arguments, and what earlier checks handed on).
`registry.FOLDER_CHECKS` lists them in the order they run, cheapest first. A new check is a
function beside its subject's and one line in the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from compressflow.params import ModelArgs


@dataclass
class Folder:
    """One model folder under check: what check_folder was asked, and what a check hands on."""

    path: Path
    args: ModelArgs
    quantized: bool = False  # a compressed model (evaluate-model's): quantization_config expected
    config: dict = field(default_factory=dict)  # config.json's settings ("config")
    settings: dict[str, dict] = field(default_factory=dict)  # settings files ("json")
    names: set[str] = field(default_factory=set)  # the weight files' tensor names ("weight files")


@dataclass(frozen=True)
class FolderCheck:
    """One folder check: its name, the field its failures blame (a ModelFetchError's; evaluate-model
    names `compressed.` for `model.`), the function that runs it on a `Folder` and refuses with a
    ModelFetchError, and whether it reads the weight files (skipped where they are not fetched)."""

    name: str
    field: str
    function: Callable[[Folder], None]
    weights: bool = False
