"""A model folder's files: what a safetensors checkpoint holds, from its headers alone (no weight
is read), and whether the folder is sound before anything loads it.

Fetch counts parameters with it, the memory plan finds the modules model_free_ptq must be told
to leave alone, and verify compares saved names with the source's and finds each source tensor's
shard.

Cheap checks that would otherwise fail after minutes of loading run here, before weights load:
a config.json that is missing or not a JSON object, or whose sizes no model has, a model that
needs `trust_remote_code` or is already quantized, a folder without a tokenizer, truncated or
malformed safetensors, a FIFO, device or folder where a model file should be, or one this worker
cannot read, a JSON file that does not parse, a chat template jinja2 cannot parse, a tokenizer
or processor that would import the repository's own code, and weights held only as pickle files
(torch.load can execute what they carry). `check_folder` runs every one of them that needs no
library (torch and transformers stay unimported), in the flow's own process: on a local folder
before any child starts, on a download after it.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from compressflow import compat
from compressflow.errors import ModelFetchError, first_line
from compressflow.limits import CONFIG_CEILINGS, MAX_JSON_BYTES, not_regular, read_json, read_text
from compressflow.logs import run_logger
from compressflow.model.download import HUB_CONFIG_PATTERNS
from compressflow.params import DEFAULT_MODEL_CLASS, ModelArgs

# Bits per element of each dtype safetensors 0.8 reads: an entry of another is refused at load.
DTYPE_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
# safetensors' own reader refuses a longer header (MAX_HEADER_SIZE in its Rust crate): a file
# claiming more is not one it would load, and reading the claim would hold that much memory.
MAX_HEADER_BYTES = 100_000_000


class HeaderError(ValueError):
    """Why a safetensors header cannot be used; callers name the file and the fix."""


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    file: Path
    dtype: str = ""  # safetensors' name for it: BF16, F8_E4M3, ...


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_entry(name: str, spec) -> None:
    """Refuse a header entry safetensors would refuse at load: one whose shape or byte range
    is not non-negative integers."""
    if name == "__metadata__":
        if not isinstance(spec, dict):
            raise HeaderError(f"its __metadata__ is a JSON {type(spec).__name__}, not an object")
        return
    if not isinstance(spec, dict):
        raise HeaderError(f"tensor {name!r} is a JSON {type(spec).__name__}, not an object")
    shape, offsets = spec.get("shape"), spec.get("data_offsets")
    if not isinstance(shape, list) or not all(_is_count(dim) for dim in shape):
        raise HeaderError(f"tensor {name!r} has shape {shape!r}, not a list of sizes >= 0")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(offset) for offset in offsets)
        or offsets[0] > offsets[1]
    ):
        raise HeaderError(f"tensor {name!r} has data_offsets {offsets!r}, not [begin, end]")
    dtype = spec.get("dtype", "")
    if not isinstance(dtype, str):
        raise HeaderError(f"tensor {name!r} has dtype {dtype!r}, not a name")
    if dtype not in DTYPE_BITS:
        raise HeaderError(
            f"tensor {name!r} has dtype {dtype!r:.40}, which safetensors does not know"
        )
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != offsets[1] - offsets[0]:
        size = f"{bits / 8:,}" if bits % 8 else f"{bits // 8:,}"
        raise HeaderError(
            f"tensor {name!r} is {dtype} of shape {shape}, {size} bytes, but its "
            f"data_offsets {offsets} hold {offsets[1] - offsets[0]:,}"
        )


def check_layout(tensors: dict) -> int:
    """Refuse byte ranges that do not tile the data from its first byte, one after another, as
    safetensors requires at load; returns where the data ends."""
    end = 0
    ranges = sorted(
        (spec["data_offsets"], name) for name, spec in tensors.items() if name != "__metadata__"
    )
    for (begin, stop), name in ranges:
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else "leaves a gap before it"
            raise HeaderError(f"tensor {name!r} starts at byte {begin:,} of the data and {what}")
        end = stop
    return end


def read_header(file: Path) -> tuple[int, dict]:
    """(header length, header) of a safetensors file, read as JSON: safetensors' own reader
    imports torch, which the flow's process does not. Raises HeaderError saying what is wrong."""
    if kind := not_regular(file):
        raise HeaderError(f"it is {kind}, not a regular file")
    size = file.stat().st_size
    with file.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise HeaderError(f"it is {size} bytes, too short to hold a header")
        length = int.from_bytes(prefix, "little")
        if length > MAX_HEADER_BYTES:
            raise HeaderError(
                f"its header claims {length:,} bytes, over the {MAX_HEADER_BYTES:,} that "
                "safetensors reads at most"
            )
        if length > size - 8:
            raise HeaderError(f"its header claims {length:,} bytes, the file has {size:,}")
        header = handle.read(length)
    try:
        tensors = json.loads(header)
    except ValueError:  # not UTF-8, not JSON, or an integer too long to convert
        raise HeaderError("its header is not JSON (corrupt header)") from None
    except RecursionError:
        raise HeaderError("its header nests too deeply to parse") from None
    if not isinstance(tensors, dict):
        raise HeaderError(f"its header is a JSON {type(tensors).__name__}, not an object")
    for name, spec in tensors.items():
        check_entry(name, spec)
    check_layout(tensors)
    return length, tensors


def tensor_index(folder: Path) -> dict[str, TensorInfo]:
    """Every tensor's shape and shard; empty when the folder holds no safetensors files.

    A file whose header is unusable is left out: fetch refuses such a source before this runs.
    """
    index: dict[str, TensorInfo] = {}
    for file in sorted(folder.glob("*.safetensors")):
        try:
            _, tensors = read_header(file)
        except HeaderError:
            continue
        for name, spec in tensors.items():
            if name != "__metadata__":
                index[name] = TensorInfo(tuple(spec["shape"]), file, spec.get("dtype", ""))
    return index


# Files of a model folder that fetch or the loaders open: those and the weights.
MODEL_FILES = [*HUB_CONFIG_PATTERNS, "*.safetensors"]


def refuse_irregular(file: Path) -> None:
    """Refuse a FIFO, device, folder or broken link where the model's files hold a file."""
    if kind := not_regular(file):
        raise ModelFetchError(
            "model.model_id",
            f"{file} is {kind}, not a regular file",
            f"replace {file.name} with the model's real file, or remove it",
        )


def check_files(path: Path) -> None:
    """Refuse a FIFO, device, folder or broken link named as a file the loaders read: opening
    it would block forever, never end, or fail as an OSError the task retries. And one this
    process may not read: the loaders would fail on it after the forkserver's imports."""
    for file in sorted(path.iterdir()):
        if not any(fnmatch(file.name, pattern) for pattern in MODEL_FILES):
            continue
        refuse_irregular(file)
        try:
            file.open("rb").close()  # a regular file: the open cannot block
        except OSError as exc:
            raise ModelFetchError(
                "model.model_id",
                f"{file} cannot be read by this worker ({exc.strerror})",
                f"make {file.name} readable by the user the worker runs as (chmod a+r), or copy "
                "the model to a folder that user owns",
            ) from None


def load_model_json(file: Path):
    """A JSON file of the model's (config.json, the shard index), its parse errors worded."""
    try:
        return read_json(file, "model.model_id", ModelFetchError)
    except json.JSONDecodeError as exc:  # transformers would fail later with no file or field
        raise ModelFetchError(
            "model.model_id",
            f"{file} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}",
            f"fix {file.name} at that position, or download the model again",
        ) from None
    except UnicodeDecodeError:
        raise ModelFetchError(
            "model.model_id",
            f"{file} is not UTF-8 text",
            f"replace {file.name} with the model's original",
        ) from None
    except ValueError as exc:  # e.g. an integer longer than Python converts (4,300 digits)
        raise ModelFetchError(
            "model.model_id",
            f"{file} cannot be read as JSON: {exc}",
            f"replace {file.name} with the model's original",
        ) from None


def check_config(path: Path, args: ModelArgs, quantized: bool = False) -> dict:
    """Refuse, from config.json alone, models that would fail only after their weights load;
    returns the config. `quantized`: the folder is a compressed model (evaluate-model's), whose
    quantization_config is expected."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelFetchError(
            "model.model_id",
            f"{path} has no config.json, so it is not a transformers model folder",
            "point model_id at the folder that holds config.json and the weights",
        )
    # The first read of a user's config.json: capped, so later reads of it need not be.
    config = load_model_json(config_file)
    if not isinstance(config, dict):
        raise ModelFetchError(
            "model.model_id",
            f"{config_file} holds a JSON {type(config).__name__}, not an object of settings",
            "replace config.json with the model's original",
        )
    model_type = config.get("model_type")
    if model_type is not None and not (isinstance(model_type, str) and model_type.strip()):
        raise ModelFetchError(
            "model.model_id",
            f"{config_file} sets model_type to {model_type!r:.80}; it must name an architecture, "
            "such as llama",
            "fix model_type in config.json, or replace config.json with the model's original",
        )
    if model_type is None and args.model_class.startswith("Auto") and not args.trust_remote_code:
        raise ModelFetchError(
            "model.model_id",
            f"{config_file} has no model_type, so transformers' {args.model_class} cannot tell "
            "which architecture to build",
            'add the model\'s model_type (e.g. "model_type": "llama") to config.json, or '
            "replace config.json with the model's original",
        )
    if (auto_map := config.get("auto_map")) and not args.trust_remote_code:
        raise ModelFetchError(
            "model.trust_remote_code",
            f"{args.model_id} defines its architecture in its own code (auto_map: "
            f"{sorted(auto_map) if isinstance(auto_map, dict) else auto_map!r:.80})",
            "set trust_remote_code: true if you trust this repository's code",
        )
    quantization = config.get("quantization_config") or config.get("compression_config")
    if quantization and not quantized:
        named = quantization if isinstance(quantization, dict) else {}
        method = named.get("quant_method") or named.get("format") or "unknown"
        raise ModelFetchError(
            "model.model_id",
            f"{args.model_id} is already quantized ({method}); compressing it again would stack "
            "errors or fail to load",
            "start from the unquantized base model",
        )
    return config


def check_sizes(path: Path, config: dict, names: set[str]) -> None:
    """Refuse core sizes in config.json that no model has, before anything builds the model
    (the memory plan and tracing build it on the meta device): a wrong type, zero or negative
    fails there with no field named, and a huge one takes minutes or gigabytes even on meta.

    A vision-language model's language model reads its own `text_config`: both are checked.
    `names` are the checkpoint's tensor names.
    """
    config_file = path / "config.json"
    text = config.get("text_config")
    for where, settings in (("", config), ("text_config.", text if isinstance(text, dict) else {})):
        for key, ceiling in CONFIG_CEILINGS.items():
            value = settings.get(key)
            # Some configs list a size per layer (Gemma 3n's intermediate_size); null means unset.
            for item in value if isinstance(value, list) else [value]:
                if item is not None and not (
                    isinstance(item, int) and not isinstance(item, bool) and 0 < item <= ceiling
                ):
                    raise ModelFetchError(
                        "model.model_id",
                        f"{config_file} sets {where}{key} to {item!r:.80}; it must be a whole "
                        f"number from 1 to {ceiling:,}",
                        f"fix {where}{key} in config.json, or replace config.json with the "
                        "model's original",
                    )
    # Layers the checkpoint holds, where its tensor names number them (`model.layers.3.mlp...`).
    held = 1 + max((int(n) for n in LAYER_NUMBER.findall("\n".join(names))), default=-1)
    claimed = (text if isinstance(text, dict) and "num_hidden_layers" in text else config).get(
        "num_hidden_layers"
    )
    if held and isinstance(claimed, int) and claimed > held:
        raise ModelFetchError(
            "model.model_id",
            f"{config_file} sets num_hidden_layers to {claimed} but the checkpoint's weights "
            f"hold {held} layers",
            "fix num_hidden_layers in config.json to match the weights, or download the model "
            "again",
        )


# Files a tokenizer loads from (a processor holds its tokenizer's too): one must be there.
TOKENIZER_FILES = ("tokenizer*", "vocab.*", "merges.txt", "*.model", "*.tiktoken")
# A decoder layer's number in a tensor name: `model.layers.3.mlp.up_proj.weight`; a longer
# number than 9 digits is no layer's, and int() refuses one of thousands.
LAYER_NUMBER = re.compile(r"(?:^|\.)layers\.(\d{1,9})\.", re.MULTILINE)


def check_tokenizer(path: Path) -> None:
    """Refuse a folder without a tokenizer: every run needs one, data-free recipes included
    (verification compares logits on tokenized text), and without it calibration fails only
    after the weights load."""
    if not any(next(path.glob(pattern), None) for pattern in TOKENIZER_FILES):
        raise ModelFetchError(
            "model.model_id",
            f"{path} holds no tokenizer (no tokenizer.json, tokenizer_config.json, "
            "tokenizer.model, vocab.* or *.tiktoken); calibration data and verification are "
            "tokenized with the model's own",
            "add the tokenizer files of the model it was trained from (its hub repository has "
            "them) to the folder; compressflow takes no separate tokenizer",
        )


# Weights torch.load unpickles: loading one of unknown origin can execute the code it carries
# (transformers' own refusal even suggests weights_only=False, the one thing never to do).
PICKLE_WEIGHTS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")
# JSON files a loader reads as an object of settings (config.json: check_config).
JSON_OBJECTS = (
    "generation_config.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "chat_template.json",
    "model.safetensors.index.json",
)
# Files whose `auto_map` makes a loader import the repository's own code (config.json's:
# check_config).
REMOTE_CODE_FILES = (
    "tokenizer_config.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
# Chat templates as files: transformers reads these beside tokenizer_config.json's own.
TEMPLATE_FILES = ("chat_template.jinja", "additional_chat_templates/*.jinja")


def local_folder(args: ModelArgs) -> Path | None:
    """The local folder `model_id` names, resolved; None for a hub or ClearML id. A path that
    does not exist (it starts with ., / or ~, or holds //) is refused, not sent to the hub."""
    if args.clearml_model:
        return None
    path = Path(args.model_id).expanduser()
    if path.exists():
        return path.resolve()
    if args.model_id.startswith((".", "/", "~")) or os.sep * 2 in args.model_id:
        raise ModelFetchError(
            "model.model_id",
            f"local folder {args.model_id} does not exist",
            "fix the path (relative paths are resolved from the worker's working directory)",
        )
    return None


def check_readable(path: Path) -> None:
    """Refuse a model_id that is not a folder this process can list."""
    if not path.is_dir():
        raise ModelFetchError(
            "model.model_id",
            f"{path} is {not_regular(path) or 'a file'}, not a model folder",
            "point model_id at the folder that holds config.json and the weights",
        )
    try:
        next(path.iterdir(), None)
    except OSError as exc:
        raise ModelFetchError(
            "model.model_id",
            f"the folder {path} cannot be listed by this worker ({exc.strerror})",
            "make it readable by the user the worker runs as (chmod a+rx), or copy the model to "
            "a folder that user owns",
        ) from None


def _json_ends(file: Path) -> None:
    """A JSON file past the cap on what is parsed here (a large tokenizer.json): refused only
    when it is cut off, which its first and last bytes show."""
    with file.open("rb") as handle:
        first = handle.read(64).lstrip()[:1]
        handle.seek(max(0, file.stat().st_size - 64))
        last = handle.read().rstrip()[-1:]
    if (first, last) not in ((b"{", b"}"), (b"[", b"]")):
        raise ModelFetchError(
            "model.model_id",
            f"{file} is not valid JSON: it is cut off (it ends in {last!r}, not a closing bracket)",
            f"replace {file.name} with the model's original, or download the model again",
        )


def check_json_files(path: Path) -> dict[str, dict]:
    """Refuse a JSON file of the folder that does not parse, or a loader's settings file that is
    not an object; returns the parsed settings files that other checks read (REMOTE_CODE_FILES,
    chat_template.json). config.json is check_config's."""
    kept: dict[str, dict] = {}
    for file in sorted(path.glob("*.json")):
        if file.name == "config.json":
            continue
        if file.stat().st_size > MAX_JSON_BYTES:
            _json_ends(file)
            continue
        data = load_model_json(file)
        if file.name in JSON_OBJECTS and not isinstance(data, dict):
            raise ModelFetchError(
                "model.model_id",
                f"{file} holds a JSON {type(data).__name__}, not an object of settings",
                f"replace {file.name} with the model's original, or download the model again",
            )
        if file.name in (*REMOTE_CODE_FILES, "chat_template.json"):
            kept[file.name] = data
    return kept


def check_remote_code(path: Path, settings: dict[str, dict], args: ModelArgs) -> None:
    """Refuse, without trust_remote_code, a tokenizer or processor whose settings make
    transformers import the repository's own code (`auto_map`)."""
    if args.trust_remote_code:
        return
    for name in REMOTE_CODE_FILES:
        if auto_map := settings.get(name, {}).get("auto_map"):
            named = sorted(auto_map) if isinstance(auto_map, dict) else auto_map
            raise ModelFetchError(
                "model.trust_remote_code",
                f"{path / name} loads its {name.split('_')[0]} from the repository's own code "
                f"(auto_map: {named!r:.80})",
                "set trust_remote_code: true if you trust this repository's code, or delete "
                f"auto_map from {name} when its class is one transformers has",
            )


def _template_environment():
    """The environment transformers compiles chat templates in: sandboxed, with its
    `{% generation %}` block and loop controls. Only parsed here, never rendered."""
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # transformers' AssistantTracker, as far as parsing goes
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    return ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )


def _templates(path: Path, settings: dict[str, dict]) -> list[tuple[str, Path, object]]:
    """(where, file, what it holds) for every chat template of the folder: text, when the file
    is well-formed."""
    found: list[tuple[str, Path, object]] = []
    value = settings.get("tokenizer_config.json", {}).get("chat_template")
    if isinstance(value, list):  # named templates: [{"name": ..., "template": ...}]
        for number, item in enumerate(value):
            name = item.get("name", number) if isinstance(item, dict) else number
            template = item.get("template") if isinstance(item, dict) else item
            found.append((f"chat_template {name!r:.40}", path / "tokenizer_config.json", template))
    elif value is not None:
        found.append(("chat_template", path / "tokenizer_config.json", value))
    if "chat_template" in settings.get("chat_template.json", {}):
        template = settings["chat_template.json"]["chat_template"]
        found.append(("chat_template", path / "chat_template.json", template))
    for pattern in TEMPLATE_FILES:
        for file in sorted(path.glob(pattern)):
            refuse_irregular(file)
            try:
                text = read_text(file, str(file), "model.model_id", ModelFetchError)
            except UnicodeDecodeError:
                raise ModelFetchError(
                    "model.model_id",
                    f"{file} is not UTF-8 text",
                    f"replace {file.name} with the model's original",
                ) from None
            found.append(("the template", file, text))
    return found


def check_templates(path: Path, settings: dict[str, dict]) -> None:
    """Refuse a chat template that is not text, or that jinja2 cannot parse: transformers
    compiles it only when a chat is first rendered (the dataset, a served model's first chat)."""
    templates = _templates(path, settings)
    if not templates:
        return
    from jinja2 import TemplateSyntaxError

    environment = _template_environment()
    for where, file, template in templates:
        fix = f"fix {where} in {file.name}, or replace {file.name} with the model's original"
        if not isinstance(template, str):
            raise ModelFetchError(
                "model.model_id",
                f"{where} in {file} is a JSON {type(template).__name__}, not the text of a "
                "template",
                fix,
            )
        try:
            environment.parse(template)
        except TemplateSyntaxError as exc:
            raise ModelFetchError(
                "model.model_id",
                f"{where} in {file} is not a valid chat template: {exc.message} (line "
                f"{exc.lineno} of the template)",
                fix,
            ) from None
        except RecursionError:
            raise ModelFetchError(
                "model.model_id", f"{where} in {file} nests too deeply to parse", fix
            ) from None


def check_pickle_weights(path: Path) -> None:
    """Refuse weights held only as pickle files: loading one runs torch.load on a file of
    unknown origin. With safetensors beside them the loaders read the safetensors."""
    if next(path.glob("*.safetensors"), None):
        return
    pickles = sorted({file.name for pattern in PICKLE_WEIGHTS for file in path.glob(pattern)})
    if not pickles:
        return
    convert = (
        'python -c "import sys; from transformers import AutoModelForCausalLM as M, '
        "AutoTokenizer as T; s, d = sys.argv[1:]; M.from_pretrained(s).save_pretrained(d); "
        f'T.from_pretrained(s).save_pretrained(d)" {path} {path}-safetensors'
    )
    raise ModelFetchError(
        "model.model_id",
        f"{path} holds its weights only as pickle files ({', '.join(pickles[:3])}"
        f"{', ...' if len(pickles) > 3 else ''}): loading them runs torch.load, which can "
        "execute code the file carries",
        f"convert them to safetensors once, where you trust the files: `{convert}` (transformers "
        "reads them with torch.load(weights_only=True), the mode that executes nothing; never "
        "switch that off), then set model_id to the new folder",
    )


def check_folder(
    path: Path, args: ModelArgs, weights: bool = True, quantized: bool = False
) -> dict:
    """Every check of a model folder that needs no library, cheapest first: the folder and the
    files the loaders open readable, every JSON file and chat template parsed, what loading
    could execute (auto_map, pickle weights), the tokenizer there, the safetensors headers whole
    and the config's sizes against them. Returns config.json's settings.

    `weights=False`: a hub model fetched without its weight files (validation), whose index
    names shards not downloaded: the weight files' checks wait for the run, which fetches them.
    `quantized`: a compressed model, as evaluate-model reads one."""
    check_readable(path)
    check_files(path)
    config = check_config(path, args, quantized)
    settings = check_json_files(path)
    check_remote_code(path, settings, args)
    check_templates(path, settings)
    check_tokenizer(path)
    if weights:
        check_pickle_weights(path)
        check_sizes(path, config, check_weight_files(path))
    return config


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
    from huggingface_hub.errors import StrictDataclassError

    try:
        config = transformers.AutoConfig.from_pretrained(path)
    # What transformers raises for a config it cannot read: an unknown model_type, a dtype torch
    # lacks, a field of the wrong type.
    except (ValueError, TypeError, AttributeError, KeyError, StrictDataclassError) as exc:
        raise ModelFetchError(
            "model.model_id",
            f"transformers cannot read {path / 'config.json'}: {first_line(exc)}",
            "fix that field of config.json, or replace config.json with the model's original",
        ) from None
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


def shard_names(index: Path) -> set[str]:
    """The shard files model.safetensors.index.json lists in its `weight_map`."""
    return set(weight_map_of(index).values())


def weight_map_of(index: Path) -> dict[str, str]:
    """model.safetensors.index.json's `weight_map`: tensor name -> shard file, each file a path
    inside the index's folder (transformers joins it to the folder: `../x` or `/x` would read
    another model's file)."""
    data = load_model_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(shard, str) for shard in weight_map.values()
    ):
        raise ModelFetchError(
            "model.model_id",
            f'{index} is not a shard index: it needs a "weight_map" object of tensor names to '
            "shard file names",
            f"replace {index.name} with the model's original, or download the model again",
        )
    outside = sorted({shard for shard in weight_map.values() if not inside_folder(shard)})
    if outside:
        raise ModelFetchError(
            "model.model_id",
            f"{index} names {len(outside)} shard file(s) that are not files inside "
            f"{index.parent}: {named(outside)}",
            f"replace {index.name} with the model's original: its weight_map names the shard "
            "files beside it (model-00001-of-00002.safetensors)",
        )
    return weight_map


def inside_folder(name: str) -> bool:
    """`name` is a relative path that stays inside the folder it is joined to."""
    parts = name.split("/")
    return (
        bool(name)
        and not name.startswith("/")
        and "\\" not in name
        and "\0" not in name
        and ":" not in parts[0]  # a Windows drive: c:x
        and all(part not in ("", ".", "..") for part in parts)
    )


def named(names, limit: int = 3) -> str:
    """The first `limit` of `names` and how many more: "['a', 'b', 'c'] and 4 more"."""
    names = list(names)
    return f"{names[:limit]}{and_more(names, limit)}"


def and_more(names: list, shown: int = 3) -> str:
    """The end of a message that lists `shown` of `names`: " and N more", or nothing."""
    return f" and {len(names) - shown} more" if len(names) > shown else ""


def loaded_files(folder: Path) -> list[Path]:
    """The safetensors files `from_pretrained` reads `folder`'s weights from: model.safetensors,
    else every file the shard index names (all of each file's tensors, whatever the index says
    of them), else none (no safetensors checkpoint transformers would find)."""
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / shard for shard in sorted(shard_names(index))]
    return []


# The weights files every loader looks for; config.json's `transformers_weights` may name another
# for transformers alone.
STANDARD_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def check_index(path: Path) -> None:
    """Refuse a sharded checkpoint whose index and shards disagree about where a tensor lives.

    transformers loads every tensor of each file the index names and no other: a tensor the index
    places in a file that lacks it is loaded from nowhere when no file it reads holds it (fresh
    random values, and only a warning), and vLLM and model-free quantization read the files by
    other rules. The index must say exactly what the shards hold: each tensor in the shard it
    names, each shard's tensors listed under that shard, no tensor in two shards. Nor may
    config.json name another weights file for transformers alone (`transformers_weights`).
    """
    config = path / "config.json"
    settings = load_model_json(config) if config.is_file() else {}
    named_file = settings.get("transformers_weights") if isinstance(settings, dict) else None
    if named_file is not None and named_file not in STANDARD_WEIGHTS:
        raise ModelFetchError(
            "model.model_id",
            f"{config} names its weights file (transformers_weights: {named_file!r:.200}): "
            "transformers would load that, while vLLM and model-free quantization read "
            f"{' or '.join(STANDARD_WEIGHTS)}",
            "delete transformers_weights from config.json and keep the weights as "
            "model.safetensors (or shards and model.safetensors.index.json)",
        )
    index = path / "model.safetensors.index.json"
    files = sorted(file.name for file in path.glob("*.safetensors"))
    if files and "model.safetensors" not in files and not index.exists():
        raise ModelFetchError(
            "model.model_id",
            f"{path} holds {named(files)} but neither model.safetensors nor {index.name}: "
            "transformers finds no weights in it",
            "name a single-file checkpoint model.safetensors, or add the shard index its "
            "conversion wrote (model.safetensors.index.json)",
        )
    if not index.exists():
        return
    weight_map = weight_map_of(index)
    fix = (
        "the index and the shards come from different downloads or were edited: download the "
        "model again (delete the folder, or its hub cache folder under HF_HOME, first), or "
        "rebuild the index's weight_map from the shards' own tensor names"
    )
    shards = sorted(set(weight_map.values()))
    if not shards:  # transformers then loads no file at all, and fails with an IndexError
        raise ModelFetchError(
            "model.model_id",
            f"{index} lists no tensors (its weight_map is empty), so transformers would load "
            f"none of the weights files beside it ({named(files) if files else 'none'})",
            fix,
        )
    if (path / "model.safetensors").exists() and shards != ["model.safetensors"]:
        raise ModelFetchError(
            "model.model_id",
            f"{path} holds two checkpoints: model.safetensors and the {len(shards)} shard(s) "
            f"{index.name} lists ({named(shards)}); transformers loads model.safetensors alone, "
            "model-free quantization and vLLM read the shards too",
            "keep one of them: delete model.safetensors, or the shards and their index, as the "
            "model's repository has it",
        )
    held: dict[str, list[str]] = {}  # tensor -> the shards that hold it
    for shard in shards:
        try:
            _, tensors = read_header(path / shard)
        except HeaderError as exc:
            raise ModelFetchError(
                "model.model_id", f"{path / shard} is not a readable safetensors file: {exc}", fix
            ) from None
        for name in tensors:
            if name != "__metadata__":
                held.setdefault(name, []).append(shard)
    misplaced = [name for name, shard in weight_map.items() if shard not in held.get(name, ())]
    if misplaced:
        others = {}  # files beside the shards the index does not list: only to say where
        for file in sorted(path.glob("*.safetensors")):
            if file.name not in shards:
                try:
                    others.update(dict.fromkeys(read_header(file)[1], file.name))
                except HeaderError:
                    continue

        def found(name: str) -> str:
            if name in held:
                return f"it is in {held[name][0]}"
            if name in others:
                return f"it is in {others[name]}, which the index does not list"
            return "no file holds it"

        where = [f"{name} in {weight_map[name]} ({found(name)})" for name in misplaced[:3]]
        raise ModelFetchError(
            "model.model_id",
            f"{index} places {len(misplaced)} tensor(s) in shards that do not hold them: "
            f"{'; '.join(where)}{and_more(misplaced)}; a loader that follows the index misses "
            "them, and transformers, which reads only the files the index lists, fills one it "
            "finds in none of them with random values",
            fix,
        )
    twice = [name for name, holders in held.items() if len(holders) > 1]
    if twice:
        where = [f"{name} in {held[name]}" for name in twice[:3]]
        raise ModelFetchError(
            "model.model_id",
            f"{len(twice)} tensor(s) are in more than one shard of {path}: {'; '.join(where)}"
            f"{and_more(twice)}; which copy loads depends on the loader",
            fix,
        )
    unlisted = [name for name in held if name not in weight_map]
    if unlisted:
        where = [f"{name} (in {held[name][0]})" for name in unlisted[:3]]
        raise ModelFetchError(
            "model.model_id",
            f"{index} does not list {len(unlisted)} tensor(s) its shards hold: "
            f"{'; '.join(where)}{and_more(unlisted)}",
            fix,
        )


def check_has_weights(path: Path) -> None:
    """Refuse a folder without a safetensors file, where a model is read now (not validated
    ahead of a fetch of its weights): transformers says only that it found no file to load."""
    if not any(path.glob("*.safetensors")):
        raise ModelFetchError(
            "model.model_id",
            f"{path} holds no weights: no .safetensors file",
            "point model_id at the folder that holds the model's weights, or publish or "
            "download it again",
        )


def check_weight_files(path: Path) -> set[str]:
    """Refuse truncated or corrupt safetensors (an interrupted download) by their headers alone;
    returns the names of the tensors they hold.

    A safetensors file is an 8-byte header length, a JSON header giving each tensor's byte range,
    then the data: a file shorter than its header says is cut off, whatever loads it later.
    """
    fix = (
        "download the model again (delete the file, or its hub cache folder under HF_HOME, "
        "first), or restore it from where it was copied"
    )
    index = path / "model.safetensors.index.json"
    if index.exists():
        missing = sorted(name for name in shard_names(index) if not (path / name).is_file())
        if missing:
            raise ModelFetchError(
                "model.model_id", f"{path} lacks shards its index lists: {missing[:3]}", fix
            )
    names: set[str] = set()
    for file in sorted(path.glob("*.safetensors")):
        try:
            length, tensors = read_header(file)
        except HeaderError as exc:
            raise ModelFetchError(
                "model.model_id", f"{file} is not a readable safetensors file: {exc}", fix
            ) from None
        size = file.stat().st_size
        end = max(
            (spec["data_offsets"][1] for name, spec in tensors.items() if name != "__metadata__"),
            default=0,
        )
        if 8 + length + end > size:
            raise ModelFetchError(
                "model.model_id",
                f"{file} is truncated: its header describes {8 + length + end:,} bytes, the file "
                f"has {size:,}",
                fix,
            )
        if 8 + length + end < size:  # safetensors: "incomplete metadata, file not fully covered"
            raise ModelFetchError(
                "model.model_id",
                f"{file} is not a readable safetensors file: {size - 8 - length - end:,} bytes "
                "follow the last tensor its header describes",
                fix,
            )
        names.update(name for name in tensors if name != "__metadata__")
    check_index(path)
    return names


def parameter_count(path: Path) -> int | None:
    """Parameters counted from safetensors headers (no weights read); None for other formats."""
    index = tensor_index(path)
    return sum(math.prod(info.shape) for info in index.values()) if index else None
