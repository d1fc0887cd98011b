"""Folder checks of the tokenizer: one is there, none imports the repository's own code unasked,
and every chat template is text jinja2 can parse.
"""

from __future__ import annotations

from pathlib import Path

from compressflow.errors import ModelFetchError
from compressflow.limits import read_text
from compressflow.model.folder_checks import FolderCheck
from compressflow.model.folder_checks.files import REMOTE_CODE_FILES, not_utf8, refuse_irregular
from compressflow.params import ModelArgs

# Files a tokenizer loads from (a processor holds its tokenizer's too): one must be there.
TOKENIZER_FILES = ("tokenizer*", "vocab.*", "merges.txt", "*.model", "*.tiktoken")


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


# Chat templates as files: transformers reads these beside tokenizer_config.json's own.
TEMPLATE_FILES = ("chat_template.jinja", "additional_chat_templates/*.jinja")


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
                raise not_utf8(file) from None
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


REMOTE_CODE = FolderCheck(
    "remote code",
    "model.trust_remote_code",
    lambda folder: check_remote_code(folder.path, folder.settings, folder.args),
)
TEMPLATES = FolderCheck(
    "templates",
    "model.model_id",
    lambda folder: check_templates(folder.path, folder.settings),
)
TOKENIZER = FolderCheck("tokenizer", "model.model_id", lambda folder: check_tokenizer(folder.path))
