"""Builds a small Llama and its tokenizer from a config and local text, with no hub access.

The demo, the tests and the benchmarks share it. Weights are random (seeded): the point is a real
transformers checkpoint that llm-compressor calibrates and vLLM-style loaders reload, not a model
that writes good prose. Building is idempotent: an existing, complete folder is reused.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from compressflow.data.local_text import python_docs

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Shape of the generated model. Widths are multiples of 128 so W4A16's groups fit."""

    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 2048
    max_position_embeddings: int = 2048
    seed: int = 0


def build_tokenizer(vocab_size: int, texts: Iterable[str] | None = None):
    """A byte-level BPE tokenizer trained on `texts` (default: the standard library's
    docstrings), with a chat template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    trained = _trained_on_docs(vocab_size) if texts is None else _train_bpe(vocab_size, texts)
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(trained),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )


def _train_bpe(vocab_size: int, texts: Iterable[str]) -> str:
    """The trained tokenizer, as its JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>", "<pad>"], show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok.to_str()


@functools.cache
def _trained_on_docs(vocab_size: int) -> str:
    """Trained once a process: the zoo builds dozens of models on the same default tokenizer
    (about 0.13 s a training), and training on the same text gives the same tokenizer."""
    return _train_bpe(vocab_size, python_docs())


def build_tiny_llama(path: str | Path, spec: TinyLlamaSpec = TinyLlamaSpec()) -> Path:
    """Write a random-weight Llama and tokenizer to `path` unless one with `spec` is there."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    marker = path / "tiny_llama_spec.json"
    if marker.exists() and json.loads(marker.read_text()) == asdict(spec):
        return path
    tokenizer = build_tokenizer(spec.vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    marker.write_text(json.dumps(asdict(spec)))  # written last: its presence means complete
    return path


def write_calibration_jsonl(path: str | Path, rows: int = 512) -> Path:
    """Local calibration data as JSON lines (`{"text": ...}`), the format users bring most."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        docs = python_docs()
        lines = [json.dumps({"text": docs[i % len(docs)]}) for i in range(rows)]
        path.write_text("\n".join(lines) + "\n")
    return path
