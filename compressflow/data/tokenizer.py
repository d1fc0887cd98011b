"""The tokenizer contract: loading the model's tokenizer or processor, its chat template, and
tokenizing texts. What decides its tokens (`tokenizer_identity`) is computed with every other key
in `compressflow.store.identity`.

A tokenizer or chat template the model's files cannot build, or a template that fails on a plain
conversation, is the model's fault (`model.model_id`); a template that fails only on a row's
messages is the row's (`dataset.dataset_name`). Rows are read and turned into text in
`compressflow.data.text_sources`.
"""

from __future__ import annotations

import hashlib

from compressflow.errors import DatasetError, ModelFetchError, first_line, interpreting
from compressflow.logs import run_logger
from compressflow.registries.datasets import SHAREGPT_ROLES
from compressflow.results import FetchedModel

# A token is rarely over a few characters: text beyond this many per token of max_seq_len is
# truncated away anyway, and a tokenizer given a giant line first would take minutes and GiBs.
MAX_CHARS_PER_TOKEN = 64


def load_tokenizer(model: FetchedModel):
    """The model's tokenizer; a tokenizer its files cannot build is the model folder's fault."""
    return tokenizer_at(model.path, model.trust_remote_code)


def tokenizer_at(path, trust_remote_code: bool = False):
    """The tokenizer in folder `path`, built and used once on a plain text with the options the
    dataset's tokenization passes: a setting that loads but fails at first use (a
    `model_max_length` of text, a `model_input_names` that is no list) is refused with the rest,
    naming the files, not at tokenization as a defect."""
    from transformers import AutoTokenizer

    # Whatever it raises is the files' fault: the tokenizers library's parser raises a bare
    # Exception for a file of the wrong shape ("data did not match any variant of untagged enum
    # ModelUntagged"), transformers a ValueError, TypeError, AttributeError or KeyError for
    # settings of the wrong type.
    with interpreting(
        "model.model_id",
        path,
        ModelFetchError,
        "the tokenizer in {source} cannot be built from its files",
        fix="replace tokenizer.json, tokenizer_config.json and special_tokens_map.json with the "
        "original model's (its hub repository has them), or remove the one the message names",
    ):
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        tokenizer(["Hello."], max_length=8, truncation=True, return_token_type_ids=False)
        tokenizer("Hello.")  # as verification and a server call it: against model_max_length
    return tokenizer


def check_tokenizer(path, trust_remote_code: bool = False) -> None:
    """`tokenizer_at`, for the fetch's child: refuses, returns nothing (a tokenizer pickled back
    would cost more than building it)."""
    tokenizer_at(path, trust_remote_code)


def load_processor(model: FetchedModel):
    """The model's processor, or its tokenizer when the processor cannot be built here.

    Qwen2.5-VL's processor requires torchvision, whose registry wheels do not load beside the
    CPU torch: text calibration needs only the tokenizer, and calibrate copies the source's
    preprocessing files into the checkpoint either way.
    """
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    except (ImportError, OSError, ValueError) as exc:
        run_logger(__name__).warning(
            "No processor for %s (%s: %s); using its tokenizer",
            model.model_id,
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
        )
        return load_tokenizer(model)


def render_messages(messages: list[dict], tokenizer) -> str:
    """Chat messages as the model sees them: its chat template, else plain 'role: content' lines."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise DatasetError(
            "dataset.text_column",
            f"a row's chat messages are {messages!r:.80}, not a list of {{role, content}} objects",
            "fix those rows (each message an object with role and content), or set text_column "
            "to a column of plain text",
        )
    messages = [
        {
            "role": SHAREGPT_ROLES.get(
                m.get("role") or m.get("from"), m.get("role") or m.get("from")
            ),
            "content": m.get("content", m.get("value")),
        }
        for m in messages
    ]
    if getattr(tokenizer, "chat_template", None) is not None:
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False)
        # Broad on purpose: a template is code; it raises jinja2's errors, its own
        # raise_exception(...), or whatever its expressions do (1 / 0).
        except Exception as exc:
            raise _template_failed(exc, messages, tokenizer) from exc
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


# A conversation every chat template must render: one that fails on it is the model's fault.
PLAIN_CHAT = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."}]


def _template_failed(exc: Exception, messages: list[dict], tokenizer) -> Exception:
    """A chat template that cannot compile, or fails on a plain user/assistant exchange too, is
    the model's fault; one that fails only on a row's messages, the row's or the template's."""
    from jinja2 import TemplateSyntaxError

    fix = (
        "fix the chat template (chat_template.jinja, or chat_template in tokenizer_config.json), "
        "or replace it with the original model's"
    )
    if isinstance(exc, TemplateSyntaxError):
        return ModelFetchError(
            "model.model_id", f"the model's chat template does not compile: {first_line(exc)}", fix
        )
    try:
        tokenizer.apply_chat_template(PLAIN_CHAT, tokenize=False)
    except Exception:  # whatever it raises, the template fails without the data
        return ModelFetchError(
            "model.model_id",
            f"the model's chat template fails on any conversation, a plain user/assistant "
            f"exchange too: {first_line(exc)}",
            fix,
        )
    roles = [m.get("role") for m in messages]
    return DatasetError(
        "dataset.dataset_name",
        f"the model's chat template fails on a row's messages (roles {roles!r:.80}): "
        f"{first_line(exc)}",
        f"give rows the messages the template accepts (the message says what it expects), {fix}, "
        "or set text_column to a column of plain text",
    )


def tokenize(texts: list[str], tokenizer, max_seq_len: int, add_special_tokens: bool):
    """input_ids and attention_mask per text: truncated to max_seq_len, unpadded, batched."""
    import datasets

    longest = max_seq_len * MAX_CHARS_PER_TOKEN

    def encode(batch):
        return tokenizer(
            [text[:longest] for text in batch["text"]],
            max_length=max_seq_len,
            truncation=True,
            add_special_tokens=add_special_tokens,
            return_token_type_ids=False,
        )

    return datasets.Dataset.from_dict({"text": texts}).map(
        encode,
        batched=True,
        remove_columns=["text"],
        keep_in_memory=True,
        # In memory, nothing is cached by this key; a fixed one spares hashing the tokenizer.
        new_fingerprint=hashlib.sha256(f"{len(texts)}:{max_seq_len}".encode()).hexdigest()[:16],
    )
