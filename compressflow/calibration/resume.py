"""Calibration checkpoints: a crashed run resumes from the last finished subgraph.

The sequential pipeline (compressflow.calibration.pipeline, the library has no resume of its own)
hands every finished subgraph to a `CalibrationCheckpoint`. At most every `interval_s` seconds it
saves, under `<cache root>/calibration-resume/<run>/`:

- `layers/p<pass>-s<subgraph>.safetensors`: the parameters and buffers of one finished subgraph,
  as calibration left them (weights quantize-dequantized, scales, zero points, smoothing);
  immutable once written, so each save writes only the subgraphs finished since the last, one
  file at a time (a save holds one subgraph's tensors, never the model's);
- `acts-p<pass>-s<subgraph>.pt`: the activations that feed the next subgraph (absent at the end
  of a pass: the next pass starts from the dataset);
- `manifest.json`: which of those files make the checkpoint, with their sha256, and where to
  go on. It is replaced last (tmp + os.replace): a crash during a save leaves the previous
  manifest and every file it names in place.

`key.json` holds what the run depends on (model, data, recipe, oneshot arguments, library and
compressflow code versions, device; not the thread count, which follows the host's load). A
checkpoint whose key differs, or whose files are missing or fail their hash, is discarded with a
warning and the run starts over. The folder is deleted once the run publishes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

from compressflow.logs import run_logger
from compressflow.settings import cache_root
from compressflow.store.atomic import write_atomic
from compressflow.store.identity import file_sha256

ROOT = "calibration-resume"
MANIFEST = "manifest.json"
KEY = "key.json"


OWN_FILE = re.compile(r"layers/p\d+-s\d+\.safetensors|acts-p\d+-s\d+\.pt")


def checkpoint_folder(run_key: str) -> Path:
    """Where a run's calibration checkpoints live; each recipe it calibrates (a target search
    calibrates several) has a subfolder named by its hash."""
    return cache_root() / ROOT / run_key[:32]


def discard(folder: Path) -> None:
    """Remove a checkpoint folder; only ever one below our own `calibration-resume` root (not a
    folder of that name elsewhere, not the root itself, not through a link)."""
    root = (cache_root() / ROOT).resolve()
    if folder.is_dir() and not folder.is_symlink() and folder.resolve().parent.is_relative_to(root):
        shutil.rmtree(folder, ignore_errors=True)


def expire(max_age_s: float) -> list[Path]:
    """Remove the run folders below our root that nothing has written into for `max_age_s`; the
    removed ones. A live run writes at least every `checkpoint_interval_s` (600 s by default),
    so only runs that crashed and were never rerun are that old."""
    root = cache_root() / ROOT
    if not root.is_dir() or root.is_symlink():
        return []
    cutoff = time.time() - max_age_s
    removed = []
    for run in sorted(root.iterdir()):
        if run.is_dir() and not run.is_symlink() and _last_written(run) < cutoff:
            discard(run)
            removed.append(run)
    return removed


def _last_written(folder: Path) -> float:
    """The newest mtime in `folder` (links not followed: a link's target is not ours)."""
    newest = folder.lstat().st_mtime
    for parent, folders, files in os.walk(folder):
        for name in folders + files:
            newest = max(newest, os.lstat(os.path.join(parent, name)).st_mtime)
    return newest


def to_device(value, device):
    """Every tensor inside tuples, lists and dicts moved to `device`."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(item, device) for item in value)
    if isinstance(value, dict):
        return {name: to_device(item, device) for name, item in value.items()}
    return value


def _state_of(modules, names: dict[int, str]) -> dict:
    """The parameters and buffers of `modules`, by qualified name, on the CPU for safetensors.

    A CPU tensor is written from its own memory. Copied are only what safetensors cannot
    write as it is: a tensor sharing memory with another (tied weights) or a view of part of
    a larger one.
    """
    import torch

    tensors, storages = {}, set()
    for module in modules:
        for attribute, value in [
            *module.named_parameters(recurse=False),
            *module.named_buffers(recurse=False),
        ]:
            tensor = value.detach().to("cpu")
            storage = tensor.untyped_storage()
            if (
                storage.data_ptr() in storages
                or storage.nbytes() != tensor.nbytes
                or not tensor.is_contiguous()
            ):
                tensor = tensor.clone(memory_format=torch.contiguous_format)
            storages.add(tensor.untyped_storage().data_ptr())
            tensors[f"{names[id(module)]}.{attribute}"] = tensor
    return tensors


class CalibrationCheckpoint:
    """Saves finished subgraphs and activations; finds, validates and restores a checkpoint.

    `interval_s`: save at most this often (0: after every subgraph; negative: never, and no
    checkpoint is read either).
    """

    def __init__(self, folder: Path, key: dict, interval_s: float):
        self.folder, self.key, self.interval_s = folder, key, interval_s
        self.log = run_logger(__name__)
        self.pending: list[tuple[int, int, list]] = []  # (pass, subgraph, modules) unsaved
        self.last_save = time.monotonic()
        self.manifest = self.load() if interval_s >= 0 else None
        # Fixed at the start: saves made by this run move `manifest` on, never the resume point.
        self.loaded = self.manifest
        self.resumed_from: str | None = None
        if self.loaded is not None:
            next_pass, next_subgraph = self.resume_at()
            per_pass = self.loaded["subgraphs"]
            self.resumed_from = f"pass {next_pass + 1}, layer {next_subgraph + 1} of {per_pass}"
            self.log.info(
                "Resuming at layer %d of %d (calibration pass %d) from the checkpoint in %s",
                next_subgraph + 1,
                per_pass,
                next_pass + 1,
                folder,
            )

    # ------------------------------------------------------------------ reading

    def load(self) -> dict | None:
        """The checkpoint's manifest when it belongs to this run and is whole; else None (and
        an unusable folder is deleted, with a warning saying why)."""
        if not self.folder.exists():
            return None
        why = self.invalid()
        if why is None:
            return json.loads((self.folder / MANIFEST).read_text())
        self.log.warning("Discarding the calibration checkpoint in %s: %s", self.folder, why)
        discard(self.folder)
        return None

    def invalid(self) -> str | None:
        try:
            key = json.loads((self.folder / KEY).read_text())
            manifest = json.loads((self.folder / MANIFEST).read_text())
        except (OSError, ValueError) as exc:
            return f"it cannot be read ({type(exc).__name__}: {exc})"
        if key != self.key:
            changed = sorted(
                name for name in {*key, *self.key} if key.get(name) != self.key.get(name)
            )
            return f"it was made from other inputs or versions ({', '.join(changed)} differ)"
        names = [*manifest["files"], *([manifest["acts"]] if manifest.get("acts") else [])]
        if foreign := [name for name in names if not OWN_FILE.fullmatch(name)]:
            # Only names this module writes: later reads and the unlink of old activations
            # must never reach outside the folder (`../`) or into a file it did not write.
            return f"it names files this project does not write ({foreign[0]!r})"
        for name, digest in manifest["files"].items():
            path = self.folder / name
            if not path.is_file() or file_sha256(path).hex() != digest:
                return f"{name} is missing or corrupt"
        return None

    def resume_at(self) -> tuple[int, int] | None:
        """(pass, first subgraph to run) of a valid checkpoint, or None: start over."""
        if self.loaded is None:
            return None
        return self.loaded["next_pass"], self.loaded["next_subgraph"]

    def restore(self, model, pass_index: int) -> None:
        """Put the saved state of pass `pass_index`'s finished subgraphs back into `model`."""
        if self.loaded is None:
            return
        from compressed_tensors.offload import update_offload_parameter
        from safetensors.torch import load_file

        for name in self.loaded["layers"]:
            if not name.startswith(f"layers/p{pass_index}-"):
                continue
            for qualified, tensor in load_file(self.folder / name).items():
                module_name, _, attribute = qualified.rpartition(".")
                module = model.get_submodule(module_name)
                if attribute in dict(module.named_parameters(recurse=False)):
                    update_offload_parameter(module, attribute, tensor)
                else:
                    getattr(module, attribute).copy_(tensor)

    def activations(self, cache_class, onload_device, offload_device):
        """The saved inputs of the next subgraph, as an `IntermediatesCache`."""
        import torch

        batches = torch.load(
            self.folder / self.loaded["acts"], map_location="cpu", weights_only=True
        )
        cache = cache_class.empty(len(batches), offload_device)
        for index, values in enumerate(batches):
            cache.update(index, to_device(values, onload_device))
        return cache

    # ------------------------------------------------------------------ writing

    def subgraph_done(self, model, pass_index, subgraph_index, subgraphs, modules, acts) -> None:
        """Note a finished subgraph; save when the interval has passed."""
        if self.interval_s < 0:
            return
        self.pending.append((pass_index, subgraph_index, modules))
        if self.interval_s == 0 or time.monotonic() - self.last_save >= self.interval_s:
            self.save(model, pass_index, subgraph_index, subgraphs, acts)
            self.last_save = time.monotonic()

    def save(self, model, pass_index, subgraph_index, subgraphs, acts) -> None:
        import torch
        from safetensors.torch import save_file

        started = time.perf_counter()
        previous = self.manifest or {"layers": [], "files": {}, "acts": None}
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "layers").mkdir(exist_ok=True)
        if not (self.folder / KEY).exists():
            write_atomic(self.folder / KEY, lambda p: p.write_text(json.dumps(self.key)))
        files = dict(previous["files"])
        files.pop(previous["acts"], None)
        names = {id(module): name for name, module in model.named_modules()}
        layers = list(previous["layers"])
        # One file per subgraph: a save holds one subgraph's tensors at a time, not every one
        # finished since the last save (at 600 s on a GPU, much of the model: a copy of it).
        for saved_pass, subgraph, modules in self.pending:
            tensors = _state_of(modules, names)
            name = f"layers/p{saved_pass}-s{subgraph}.safetensors"
            write_atomic(self.folder / name, lambda p, t=tensors: save_file(t, p))
            del tensors
            layers.append(name)
            files[name] = file_sha256(self.folder / name).hex()

        finished_pass = subgraph_index == subgraphs - 1
        acts_name = None
        if not finished_pass:
            acts_name = f"acts-p{pass_index}-s{subgraph_index}.pt"
            batches = [to_device(acts.fetch(index), "cpu") for index in range(len(acts))]
            write_atomic(self.folder / acts_name, lambda p: torch.save(batches, p))
            files[acts_name] = file_sha256(self.folder / acts_name).hex()
        manifest = {
            "layers": layers,
            "acts": acts_name,
            "files": files,
            "next_pass": pass_index + 1 if finished_pass else pass_index,
            "next_subgraph": 0 if finished_pass else subgraph_index + 1,
            "subgraphs": subgraphs,
            "finished_subgraphs": subgraph_index + 1,
            "pid": os.getpid(),
        }
        write_atomic(self.folder / MANIFEST, lambda p: p.write_text(json.dumps(manifest)))
        # Only now is the previous generation's activations file no longer needed.
        if previous["acts"] and previous["acts"] != acts_name:
            (self.folder / previous["acts"]).unlink(missing_ok=True)
        self.manifest, self.pending = manifest, []
        self.log.debug(
            "Calibration checkpoint after layer %d of %d saved in %.2f s",
            subgraph_index + 1,
            subgraphs,
            time.perf_counter() - started,
        )
