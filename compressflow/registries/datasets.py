"""Dataset shortcuts: short names for calibration datasets, as plain data.

Every shortcut llm-compressor 0.14 registers is here (same hub ids and row formats), plus
`python_docs`, which needs no network. `compressflow.data.text_sources` reads these entries;
nothing here runs code. An entry holds:

- `description`: one line for humans.
- where rows come from, exactly one of
  - `hub_id` (+ optional `config`, `data_files`): passed to `datasets.load_dataset`;
  - `local_rows`: `module:function` returning a list of strings (offline shortcuts).
- `split`: the default split; `split_aliases` maps a requested split to the hub's name for it.
- `format`, how one row becomes a calibration sample:
  - `"text"`: `column` holds the text;
  - `"messages"`: `column` holds chat messages, rendered with the model's chat template;
  - `"template"`: `templates` are `str.format` patterns over the row's columns; the first whose
    fields are all non-empty is used, the last is the fallback;
  - `"image_caption"`: `image_column` holds an image, `column` its caption(s) (vision samples);
  - `"audio"`: audio rows, which compressflow does not build (the entry exists to say so).
"""

from __future__ import annotations

# ShareGPT-style conversations ({"from": "human", "value": ...}) use other role names.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}

_ALPACA_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n{output}"
)
_ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n{output}"
)
_EVOL_CODE = (
    "Below is an instruction that describes a programming task. Write a program that "
    "appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n"
    "### Response:\n{output}"
)

SHORTCUTS: dict[str, dict] = {
    "python_docs": {
        "description": "Docstrings of the Python standard library; works offline.",
        "local_rows": "compressflow.data.local_text:python_docs",
        "split": "train",
        "format": "text",
        "column": "text",
    },
    "c4": {
        "description": "allenai/c4, first English shard: web text, the classic calibration set.",
        "hub_id": "allenai/c4",
        # One shard (~350k rows) instead of the whole 300 GB corpus, as llm-compressor's examples do.
        "data_files": {"train": "en/c4-train.00000-of-01024.json.gz"},
        "split": "train",
        "format": "text",
        "column": "text",
    },
    "cnn_dailymail": {
        "description": "CNN/DailyMail news articles with their summaries.",
        "hub_id": "cnn_dailymail",
        "config": "3.0.0",
        "split": "train",
        "format": "template",
        "templates": ["Article:\n{article}\n\n### Summarization:\n{highlights}\n"],
    },
    "evolcodealpaca": {
        "description": "Evol-CodeAlpaca programming instructions and solutions.",
        "hub_id": "theblackcat102/evol-codealpaca-v1",
        "split": "train",
        "format": "template",
        "templates": [_EVOL_CODE],
    },
    "gsm8k": {
        "description": "Grade-school math word problems with worked answers.",
        "hub_id": "openai/gsm8k",
        "config": "main",
        "split": "train",
        "format": "template",
        "templates": ["Question: {question}\nAnswer: {answer}"],
    },
    "open_platypus": {
        "description": "Open-Platypus instructions in the Alpaca prompt format.",
        "hub_id": "garage-bAInd/Open-Platypus",
        "split": "train",
        "format": "template",
        "templates": [_ALPACA_INPUT, _ALPACA_NO_INPUT],
    },
    "perfectblend": {
        "description": "Open-PerfectBlend: mixed chat conversations (ShareGPT format).",
        "hub_id": "mlabonne/open-perfectblend",
        "split": "train",
        "format": "messages",
        "column": "conversations",
    },
    "ultrachat_200k": {
        "description": "UltraChat 200k: multi-turn chat conversations, a common chat-model set.",
        "hub_id": "HuggingFaceH4/ultrachat_200k",
        "split": "train_sft",
        "split_aliases": {"train": "train_sft", "test": "test_sft"},
        "format": "messages",
        "column": "messages",
    },
    "wikitext": {
        "description": "WikiText-2 (raw): Wikipedia article text.",
        "hub_id": "Salesforce/wikitext",
        "config": "wikitext-2-raw-v1",
        "split": "train",
        "format": "text",
        "column": "text",
    },
    "flickr": {
        "description": "Flickr30k images with captions, for vision-language models.",
        "hub_id": "lmms-lab/flickr30k",
        "split": "test",  # the only split this hub copy has
        "format": "image_caption",
        "image_column": "image",
        "column": "caption",
    },
    "peoples_speech": {
        "description": "People's Speech audio clips with transcripts, for speech models.",
        "hub_id": "MLCommons/peoples_speech",
        "config": "test",
        "split": "test",
        "format": "audio",
        "column": "text",
    },
}

# Other names llm-compressor accepts for the same shortcuts.
ALIASES = {"flickr30k": "flickr", "ultrachat": "ultrachat_200k"}


def lookup(name: str) -> dict | None:
    """The entry for a shortcut name or alias, or None when `name` is not a shortcut."""
    return SHORTCUTS.get(ALIASES.get(name, name))
