"""Loading a model's weights with transformers: the whole model from its files, or refused.

`from_pretrained` fills a parameter or persistent buffer the checkpoint's files do not hold (a
hand-edited index, files from two revisions, a conversion that renamed keys), or hold in another
shape, with fresh random values, and only warns. A model calibrated that way, then verified
against a base loaded the same way, was published as verified. So every load of weights goes
through `load_complete` (tests/unit/test_complete_load.py finds any other `from_pretrained` of
weights), which refuses such a load naming the tensors, the files and the fix.

`headers_load` matches the same keys on the meta device from the safetensors headers, reading no
weight: `check_loads_completely` refuses an incomplete source before calibration with the same
error, and verify's reload of a model-free output checks its keys with it. The keys transformers
leaves out by design (tied weights, `_keys_to_ignore_on_load_missing`, non-persistent buffers)
are not in its report, so they are never refused.

`loading_class` names the class that loads a model: the one asked for, or the one its config.json
names when AutoModelForCausalLM would load something else.
"""

from __future__ import annotations

import logging
from pathlib import Path

from compressflow import compat
from compressflow.errors import InputError, ModelFetchError, interpreting
from compressflow.logs import run_logger
from compressflow.model.shards import loaded_files, named, weight_map_of
from compressflow.model.transforms import attach_transforms, declared_in
from compressflow.params import DEFAULT_MODEL_CLASS, ModelArgs
from compressflow.results import FetchedModel

FIX = (
    "the checkpoint's files do not hold these tensors under the names and shapes this model "
    "class loads: download or convert the model again; if the class is wrong, set "
    "model.model_class"
)


def load_complete(
    model_cls,
    path,
    what: str,
    field: str = "model.model_id",
    unexpected: bool = True,
    **options,
):
    """`model_cls.from_pretrained(path, **options)`, refused with an InputError on `field` when
    a tensor the model needs is not in the files or has another shape there (`unexpected=False`:
    also when the files hold a tensor the class does not load). `what` names the model in the
    message ("the source model"). The online transforms a checkpoint declares are attached and
    filled from their tensors (compressflow/model/transforms.py), which are then no stray keys."""
    with compat.loading_reports() as reports:
        try:
            # Mismatched shapes are refused below, with the files named, not raised mid-load.
            loaded = model_cls.from_pretrained(path, ignore_mismatched_sizes=True, **options)
        except RuntimeError:  # transformers raises on weights it could not convert
            if reports and (problem := incomplete(reports[-1], Path(path), unexpected)):
                raise InputError(field, f"{what} at {path} does not load: {problem}", FIX) from None
            raise
    if not reports:
        raise RuntimeError(f"transformers made no loading report for {path}: adapter defect")
    report = reports[-1]
    if declared_in(Path(path)):  # a rotation's transforms: attached, or the model is not its own
        filled = attach_transforms(loaded, Path(path), set(report["unexpected_keys"]))
        report = {**report, "unexpected_keys": set(report["unexpected_keys"]) - filled}
    if problem := incomplete(report, Path(path), unexpected):
        raise InputError(field, f"{what} at {path} does not load completely: {problem}", FIX)
    return loaded


def headers_load(folder: Path, model_class: str, trust_remote_code: bool):
    """`from_pretrained` of the tensors the real load reads from `folder` (`loaded_files`), as
    empty meta tensors from the safetensors headers: (meta model, report as `load_complete`
    reads it). No weight is read.

    transformers takes a state dict only without a folder, so the class is the concrete one the
    config names (an Auto class resolves it from a folder).
    """
    import transformers

    from compressflow.model.tracing import meta_model

    config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    cls = type(meta_model(config, model_class, trust_remote_code))
    # Its warning table says missing weights were "newly initialized": on meta, none were; the
    # caller words what the report says.
    report_log = logging.getLogger("transformers.modeling_utils")
    report_log.addFilter(no_load_report)
    try:
        with compat.loading_reports() as reports:
            loaded = cls.from_pretrained(
                None,
                config=config,
                state_dict=compat.headers_state_dict(loaded_files(folder)),
                dtype="auto",
                device_map="meta",
                ignore_mismatched_sizes=True,
            )
    finally:
        report_log.removeFilter(no_load_report)
    return loaded, reports[-1]


def no_load_report(record: logging.LogRecord) -> bool:
    """A logging filter: drops transformers' table of the keys a load missed."""
    return "LOAD REPORT" not in record.getMessage()


def check_loads_completely(model: FetchedModel, folder: Path | None = None) -> str:
    """Refuse a source (its folder: `folder`, else `model.path`) that transformers would load
    with tensors missing or misshapen, as `load_complete` would, from the headers alone: before
    calibration, in seconds. Says what it checked."""
    folder = Path(folder or model.path)
    files = loaded_files(folder)
    if not files:  # a checkpoint of another format
        return "not checked: the folder holds no safetensors weights"
    if not all(file.is_file() for file in files):  # validation fetched a hub model's config alone
        return "not checked: the weight files are not downloaded (the run checks them)"
    meta, report = headers_load(folder, model.model_class, model.trust_remote_code)
    if problem := incomplete(report, folder, unexpected=True):
        raise InputError(
            "model.model_id",
            f"the source model at {folder} does not load completely: {problem}",
            FIX,
        )
    count = len(meta.state_dict())
    return f"all {count} tensors the model loads are in its {len(files)} file(s)"


def incomplete(report: dict, folder: Path, unexpected: bool) -> str:
    """What `report` says the load lacks ("" when nothing): missing and mismatched keys, with the
    files the checkpoint says hold them; unexpected keys too unless `unexpected` allows them."""
    missing = sorted(report["missing_keys"])
    mismatched = sorted(report["mismatched_keys"])
    extra = sorted(report["unexpected_keys"])
    errors = report.get("conversion_errors") or {}
    problems = []
    if missing:
        problems.append(
            f"missing keys {named(missing)}: {len(missing)} tensor(s) the model needs that no "
            f"file it loads holds{placed(missing, folder)}"
        )
    if mismatched:
        shapes = [
            f"{name} {list(saved)} in the files, {list(expected)} in the model"
            for name, saved, expected in mismatched
        ]
        problems.append(f"mismatched keys {named(shapes)}")
    if problems:
        problems[-1] += ", which transformers would fill with random values and only warn"
    if errors:
        problems.append(
            "weights transformers could not convert: "
            + named([f"{name}: {message}" for name, message in sorted(errors.items())])
        )
    if extra and not unexpected:
        problems.append(f"unexpected keys {named(extra)}: tensors the class does not load")
    elif extra and problems:  # a renamed tensor shows up here under its new name
        problems.append(f"the files hold {len(extra)} tensor(s) it does not load: {named(extra)}")
    return "; ".join(problems)


def placed(names: list[str], folder: Path) -> str:
    """Where the checkpoint says `names` live: the files its shard index places them in."""
    files = loaded_files(folder)
    index = folder / "model.safetensors.index.json"
    if not files or files == [folder / "model.safetensors"] or not index.is_file():
        return f" ({files[0].name if files else 'no safetensors file'} holds none of them)"
    weight_map = weight_map_of(index)
    shards = sorted({weight_map[name] for name in names if name in weight_map})
    if shards:
        return f" ({index.name} places them in {named(shards)})"
    return f" ({index.name} lists none of them)"


def loading_class(path: Path, args: ModelArgs) -> str:
    """The transformers class that loads the model: `model_class`, or, with the default, the one
    config.json names when AutoModelForCausalLM would load something else (vision-language
    models: none at all, or Mllama's text-only class, which cannot read the full config)."""
    import transformers

    if args.model_class != DEFAULT_MODEL_CLASS or args.trust_remote_code:
        if not hasattr(transformers, args.model_class):
            raise ModelFetchError(
                "model.model_class",
                f"'{args.model_class}' is not a transformers class",
                "use a transformers class name, e.g. AutoModelForCausalLM",
            )
        return args.model_class
    # What transformers raises reading it (an unknown model_type, a dtype torch lacks, a field
    # of the wrong type, a rope setting without its keys) is the file's fault.
    with interpreting(
        "model.model_id", path / "config.json", ModelFetchError, "transformers cannot read"
    ):
        config = transformers.AutoConfig.from_pretrained(path)
    refuse_stray_text_config(config, path)
    mapping = compat.causal_lm_classes()
    default = mapping[type(config)].__name__ if type(config) in mapping else None
    named = [name for name in (config.architectures or []) if hasattr(transformers, name)]
    if default is not None and (not named or named[0] == default):
        return args.model_class
    if not named:
        raise ModelFetchError(
            "model.model_class",
            f"AutoModelForCausalLM cannot load {args.model_id} ({type(config).__name__}) and its "
            "config.json names no transformers class",
            "set model.model_class to the class that loads it, e.g. AutoModelForImageTextToText",
        )
    run_logger(__name__).info(
        "%s is a %s: loading it with %s", args.model_id, type(config).__name__, named[0]
    )
    return named[0]


def interpreted_class(path: Path, args: ModelArgs) -> str:
    """`loading_class`, once that class builds from the folder's config.json on the meta device:
    what transformers raises interpreting the file (a rope type the class does not know, a
    dtype that is no float) is the file's refusal at fetch, in its child, before the dataset is
    built, not a defect of a later stage. A Llama-3-70B config builds in about half a second
    here (docs/errors.md, Faults)."""
    import transformers

    from compressflow.model.tracing import meta_model

    name = loading_class(path, args)
    with interpreting(
        "model.model_id", path / "config.json", ModelFetchError, "transformers cannot read"
    ):
        config = transformers.AutoConfig.from_pretrained(
            path, trust_remote_code=args.trust_remote_code
        )
    meta_model(config, name, args.trust_remote_code)
    return name


def refuse_stray_text_config(config, path: Path) -> None:
    """Refuse a `text_config` that is not a language model's configuration: on a config class
    without one (a Llama's) transformers keeps whatever config.json holds there, and every later
    get_text_config() fails on it ('str' object has no attribute 'to_dict'), or, for null, the
    trace fails blaming the pipeline."""
    from transformers import PretrainedConfig

    if hasattr(config, "text_config") and not isinstance(config.text_config, PretrainedConfig):
        raise ModelFetchError(
            "model.model_id",
            f"{path / 'config.json'} sets text_config to {config.text_config!r:.60}, which a "
            f"{type(config).__name__} does not have: transformers keeps it as a plain value and "
            "fails on it when it builds the model",
            "remove text_config from config.json (a vision-language model's belongs to its own "
            "model_type), or replace config.json with the model's original",
        )
