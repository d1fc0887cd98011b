"""The checks compress-model makes before calibrating, shared with `compressflow validate`.

Both run the same two steps, so they cannot drift: `resolve_inputs` (first `precheck`, whatever
the files decide without torch, in this process; then render the recipe and refuse what this
worker's hardware cannot run, or a quality target the recipe cannot search; fetch the model,
refuse an output or offload folder that overlaps a file or folder the run reads (`sources_read`),
build the dataset: the cheap stages, in the order that fails fastest) and
`check_before_calibration` (the output folder, disk space, the memory plan, traceability on the
meta device).
The flow runs them as Prefect tasks through `compressflow.runtime.stages.Stages` (cached, recorded) and
puts its output lock and reuse check between the two; validate calls the stages' functions
directly, without weights, and times each check.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from compressflow.data.text_sources import check_local, local_source
from compressflow.errors import PublishError, SettingsError
from compressflow.flows.strategies import choose
from compressflow.inputs import Inputs, RunArgs
from compressflow.model.args import is_store_uri
from compressflow.model.folder_checks.files import local_folder
from compressflow.model.folder_checks.registry import check_folder
from compressflow.model.hardware import (
    needs_accelerator,
    refuse_fp4_on_float32,
    refuse_unsupported,
)
from compressflow.model.loading import check_loads_completely
from compressflow.model.methods_fit import refuse_unfit_methods
from compressflow.params import DatasetArgs, HeldOutArgs
from compressflow.recipes.render import fill
from compressflow.registries.datasets import lookup
from compressflow.registries.presets import PRESETS
from compressflow.results import MemoryPlan
from compressflow.runtime.gpus import refuse_fewer_samples, refuse_too_few
from compressflow.runtime.isolation import in_child, warm_up
from compressflow.settings import variable
from compressflow.store.disk_space import check_free_space
from compressflow.store.identity import hashing_early, run_key
from compressflow.store.objects import probe
from compressflow.store.output import (
    check_apart,
    check_output_path,
    check_target,
    check_upload_apart,
    output_path,
)
from compressflow.store.sources import check_source
from compressflow.tasks.adapt_recipe import adapt_recipe
from compressflow.tasks.build_dataset import build_dataset
from compressflow.tasks.check_traceability import check_traceability
from compressflow.tasks.fetch_model import fetch_model
from compressflow.tasks.plan_memory import plan_memory
from compressflow.tasks.render_recipe import render_recipe

# run(stage, *args) -> the stage's result; a stage is a Prefect task or a plain check function.
Runner = Callable[..., Any]


def sources_read(args: RunArgs, model: str | Path | None) -> list[tuple[str, Path]]:
    """Every local file or folder the run reads, each (what it is and the parameter naming it,
    its path): what the output, an offload folder and an upload must keep apart from. `model`:
    the model's local folder, when it has one. A new input the run reads is a line here."""
    held_out = args.target.held_out if args.target.wanted() else None
    places = [
        ("the source model's folder (model.model_id)", model),
        ("the calibration data (dataset.dataset_name)", local_data(args.dataset)),
        ("the recipe file (recipe.recipe)", _recipe_file(args.recipe.recipe)),
        ("the held-out text (target.held_out.dataset_name)", local_data(held_out)),
    ]
    return [(what, Path(place)) for what, place in places if place]


def local_data(source: DatasetArgs | HeldOutArgs | None) -> Path | None:
    """The existing local file or folder a text source names (a loader's too); None for a
    shortcut, a hub id or a path that is not there (refused, if the run reads it, by its own
    check)."""
    if source is None or lookup(source.dataset_name) is not None:
        return None
    path = Path(source.dataset_name).expanduser()
    return path if os.path.lexists(path) else None


def _recipe_file(recipe: str) -> Path | None:
    """The existing .yaml/.yml file `recipe.recipe` names, as compressflow.recipes.load reads it."""
    text = recipe.strip()
    path = Path(text).expanduser()
    if "\n" in text or path.suffix.lower() not in (".yaml", ".yml"):
        return None
    return path if os.path.lexists(path) else None


def precheck(args: RunArgs) -> None:
    """Refuse what the files alone decide, in this process, before the forkserver is needed.

    The stages after this wait for the forkserver's imports of torch, transformers and
    llm-compressor (6 s warm, much more on a busy machine); these checks import none of them, so
    a mistake is refused in about the time the process takes to start. In the order
    resolve_inputs would meet them: the recipe's parts against one another (its YAML, the preset,
    placeholders and recipe_args; llm-compressor's own validation stays in render_recipe); a local
    model folder, whole (compressflow.model.folder_checks.registry.check_folder; a hub or
    ClearML model is checked once downloaded); a model in object storage, by one listing of its
    prefix (compressflow.store.sources.check_source: the store's refusals, before any
    download); the output folder against every file and folder the run reads (`sources_read`)
    and the filesystem, when save_directory names it; a local data file a preset calibrates on
    (a custom recipe's need for data is llm-compressor's to say, after render); last, `upload_uri`
    (`check_upload`: the one check here that asks the network).
    """
    model, output, calibration = args.model, args.output, args.calibration
    _, _, preset, values = fill(args.recipe)
    local = local_folder(model)
    if is_store_uri(model.model_id):  # one listing: URI, bucket, credentials, an empty prefix
        check_source(model.model_id, model.storage_credentials)
    target = Path(output.save_directory).expanduser() if output.save_directory else None
    sources = sources_read(args, local)
    if target is not None:
        # Before the folder's checks: they read it, and a publish could replace it.
        check_apart(target, sources, calibration.offload_folder)
    if local is not None:
        check_folder(local, model)
    if target is not None:
        check_output_path(target.resolve())
    dataset = args.dataset
    needs_data = preset is not None and (
        PRESETS[preset].needs_data or bool(values.get("kv_cache_scheme"))
    )
    if needs_data and (dataset.text_samples or dataset.vision_samples):
        if (data := local_source(dataset)) is not None:
            check_local(data)
    if output.upload_uri:
        check_upload(args, sources, target)


def check_upload(args: RunArgs, sources: list[tuple[str, Path]], target: Path | None):
    """`output.upload_uri` apart from the output folder and every source the run reads
    (`sources`, and a model's own URI), then writable: probed, a small object written and
    deleted, so a missing bucket, credentials the store refuses and a prefix they may not write
    are refused before any weights load (compressflow.store.objects.probe)."""
    model, output = args.model, args.output
    places = [
        *sources,
        ("the source model", model.model_id if is_store_uri(model.model_id) else None),
        ("the output folder (output.save_directory)", target),
    ]
    check_upload_apart(output.upload_uri, [(what, place) for what, place in places if place])
    probe(output.upload_uri, output.upload_credentials)


@contextmanager
def default_output(named: bool) -> Iterator[None]:
    """An output folder no save_directory `named` is the worker's COMPRESSFLOW_OUTPUT_DIR's: a
    refusal of it names that setting, not a parameter the user left empty."""
    try:
        yield
    except PublishError as error:
        if named:
            raise
        raise SettingsError(
            variable("output_dir"),
            f"{error.problem} (the default output folder, under {variable('output_dir')})",
            f"set {variable('output_dir')} on the worker to a folder on a disk this worker's user "
            "may write, or name output.save_directory",
        ) from None


def resolve_inputs(run: Runner, args: RunArgs, weights: bool = True) -> Inputs:
    """What the cheap stages make of `args`, in the order that fails fastest."""
    model, dataset, recipe, output = args.model, args.dataset, args.recipe, args.output
    calibration = args.calibration
    precheck(args)
    # Only now: the checks above are not kept waiting while it imports. A flow started it at
    # its start already (its imports overlap opening the ClearML task); then this is a no-op.
    warm_up()
    # Render waits seconds for those imports: a local folder's content hash runs meanwhile.
    with hashing_early(local_folder(model)):
        rendered = run(render_recipe, recipe)
        # Not a stage: a check of this worker's hardware (torch's view of it), never cached.
        # Asked of torch only for a recipe that needs an accelerator: the child waits for the
        # forkserver's imports, which cost a reused run 5 s it had no other use for.
        if needs_accelerator(rendered):
            in_child(refuse_unsupported, rendered)
        # A target needs what its strategy measures: refused before anything downloads. Mixing
        # needs a preset of a known precision family; leaving modules out, GPTQ's per-module
        # error.
        choose(rendered, args.target).check(rendered, args.target)
        fetched = run(fetch_model, model, weights)
    refuse_fp4_on_float32(rendered, fetched)
    refuse_unfit_methods(rendered, fetched, recipe)  # experts to prune, widths to rotate
    rendered = run(adapt_recipe, rendered, fetched)
    target = output_path(output, fetched, rendered)
    # The model as fetched (a hub snapshot's cache), and the default output now known.
    sources = sources_read(args, fetched.path)
    with default_output(named=bool(output.save_directory)):
        # Whatever `overwrite` says, before the dataset builds: no input is ever written to.
        check_apart(target, sources, calibration.offload_folder)
        if output.upload_uri:
            check_upload_apart(output.upload_uri, [*sources, ("the output folder", target)])
        check_output_path(target)
    built = run(build_dataset, dataset, fetched, rendered.needs_data)
    return Inputs(
        args=args,
        recipe=rendered,
        model=fetched,
        dataset=built,
        target=target,
        key=run_key(fetched, built, rendered, recipe, output, calibration, args.target),
    )


def check_output(inputs: Inputs) -> Path:
    """The output folder takes this model, and its disk has room for the checkpoint."""
    output = inputs.args.output
    check_target(inputs.target, inputs.key, output.overwrite)
    in_child(  # reads the scheme's bits from compressed-tensors
        check_free_space,
        inputs.target.parent,
        inputs.model,
        inputs.recipe.scheme,
        output.save_compressed,
    )
    return inputs.target


def check_weights(inputs: Inputs) -> str:
    """The source loads whole: every tensor its class needs is in the files transformers reads,
    in its shape (matched on the meta device from the headers, no weight read), else refused
    before anything is calibrated or verified against a half-random model."""
    return in_child(check_loads_completely, inputs.model)


def check_before_calibration(run: Runner, inputs: Inputs) -> MemoryPlan:
    gpus = inputs.args.calibration.gpus
    refuse_too_few(gpus)  # before the output's checks: the host is wrong, not them
    refuse_fewer_samples(gpus, inputs.dataset and inputs.dataset.num_samples)
    run(check_weights, inputs)
    run(check_output, inputs)
    plan = run(plan_memory, inputs)
    if plan.path == "classic":  # the model-free path builds no model: nothing to trace
        run(check_traceability, inputs.model, inputs.recipe, inputs.dataset, inputs.args.recipe)
    return plan
