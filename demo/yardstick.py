"""The yardstick: a small Llama with learned weights, on which quality claims are measured.

`MOE_SPEC` trains the same way a Mixtral-shaped sibling (8 small experts a layer, the router
picks 2), on which expert pruning (REAP) is judged: dropping experts costs what the trained
routing makes it cost, which random experts cannot show.

Random weights (`assets.build_tiny_llama`) say nothing about accuracy. This module trains a
Llama-shaped causal LM, deterministically and offline, on the source code of the Python standard
library that runs it, and keeps a held-out split (whole files) that neither the tokenizer, the
training nor calibration ever sees. Tests and benchmarks score compressed copies on that split.

It is built to be sensitive to quantization, which is the point of it. A wide, briefly trained
model is not: its weights stay close to their small random initialisation, it uses few of its
directions, and 4-bit round-to-nearest costs it almost nothing (4 layers x 256 wide, 12 CPU
minutes: 0.1% perplexity). What made a few CPU minutes of training sensitive, measured while
choosing the spec (held-out perplexity increase under round-to-nearest W4A16 / under 10%
Gaussian noise on every decoder weight):

- narrow beats wide: 128 wide saturates sooner than 256 or 512 in the same CPU time
  (+0.8% vs +0.04% to +0.2%);
- a larger initialisation, 0.09 instead of transformers' 0.02, with a lower learning rate: the
  learned function leans on all of its weights, not on a small update to near-zero ones
  (noise +0.6% at 0.02, +3.2% at 0.09);
- learning rates above 3e-3, a small initialisation, longer context, a smaller vocabulary: no
  better, or worse;
- 1000 steps, not 1500: a first `make demo` trains it, and its four minutes included the
  install. Held-out perplexity 41.5 instead of 32.3; round-to-nearest W4A16 costs +2.33%
  (+2.74% after 1500 steps) and GPTQ +1.09% to +1.18% over 3 calibration seeds (+1.22% to
  +1.41%): still the yardstick's two properties, in a third less time
  (docs/benchmarks/quality.md, "The yardstick now").

Training uses two threads, or one where the worker may use only one CPU (its affinity mask and
cgroup quota): torch's CPU kernels split work by the thread count, so a fixed count gives the same
weights on every build with the same software and CPU, and two halve the build (about 110 s on a
quiet 2-core host, against 200 s for one). The count is part of the key. Build it on a quiet machine:
two threads whose partner is descheduled spin (four times slower beside another busy process).
The folder is reused while its key (spec, threads, Python, torch and transformers versions,
this file's hash) is unchanged.

    python -m compressflow.demo.yardstick [ROOT] [--moe]   # builds (or finds) it, prints figures
"""

from __future__ import annotations

import json
import math
import platform
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from compressflow.demo.assets import build_tokenizer
from compressflow.evaluation import quality
from compressflow.model.cpus import usable_cpus
from compressflow.store.atomic import write_atomic
from compressflow.store.identity import file_sha256

SPEC_FILE = "yardstick_spec.json"
BUILDING = ".yardstick-building"  # in the model folder from a build's start to its marker
MODEL_DIR = "yardstick-llama"
MOE_MODEL_DIR = "yardstick-mixtral"  # the model folder of a spec with experts
# What a build writes under its root, and so may write over (an interrupted build's leftovers).
OURS = {MODEL_DIR, MOE_MODEL_DIR, "calibration.jsonl", "held_out.jsonl", LOCK := ".build.lock"}
TRAINING_THREADS = 2


@dataclass(frozen=True)
class YardstickSpec:
    """Shape, data and training of the yardstick. Widths are multiples of 128 (W4A16's groups)."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 2
    num_key_value_heads: int = 2
    vocab_size: int = 1024
    init_std: float = 0.09
    seq_len: int = 128  # training context; held-out and calibration texts are this long
    batch_size: int = 8
    steps: int = 1000
    learning_rate: float = 2e-3
    warmup_steps: int = 50
    # Every `held_out_every`-th standard-library module (sorted by name, from the third) is held
    # out: whole files, so no function or docstring is half in training and half in evaluation.
    held_out_every: int = 10
    calibration_texts: int = 2048
    seed: int = 0
    # 0: a dense Llama. More: a Mixtral with that many experts per layer (each
    # `intermediate_size` wide), of which the router picks `experts_per_token`.
    experts: int = 0
    experts_per_token: int = 2

    @property
    def model_dir(self) -> str:
        return MOE_MODEL_DIR if self.experts else MODEL_DIR


# The MoE yardstick: 8 experts 128 wide (the narrowest W4A16's groups of 128 allow), 2 picked per
# token, so a token's MLP is 256 wide, no costlier to train than the dense one's 384.
MOE_SPEC = YardstickSpec(intermediate_size=128, experts=8, experts_per_token=2)


@dataclass(frozen=True)
class Yardstick:
    """Where a built yardstick lies: the model folder and its two JSON-lines text files."""

    model: Path  # a transformers folder: config, safetensors, tokenizer
    calibration: Path  # {"text": ...} rows from training files, ~seq_len tokens each
    held_out: Path  # {"text": ...} rows from held-out files, never trained or calibrated on
    spec: YardstickSpec
    built: dict  # what the build measured: seconds, final loss, held-out perplexity

    def held_out_texts(self) -> list[str]:
        return [json.loads(line)["text"] for line in self.held_out.read_text().splitlines()]


def corpus_files(spec: YardstickSpec) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): the standard library's public top-level modules."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if not p.name.startswith(("_", "test")))
    held_out = files[3 :: spec.held_out_every]
    return [f for f in files if f not in held_out], held_out


def _read(files: list[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def windows(tokenizer, texts: list[str], length: int) -> list[str]:
    """Each text cut into consecutive pieces of `length` tokens, as text (cut at token edges).

    Cutting the text at the tokens' character offsets, not decoding token ids, keeps every piece
    an exact substring of the source, so it re-tokenizes to (almost exactly) the same tokens.
    """
    pieces = []
    # The backend tokenizer: whole files exceed model_max_length, which only the wrapper warns of.
    for text, encoding in zip(texts, tokenizer.backend_tokenizer.encode_batch(texts), strict=True):
        offsets = encoding.offsets
        for start in range(0, len(offsets) - length + 1, length):
            pieces.append(text[offsets[start][0] : offsets[start + length - 1][1]])
    return pieces


def _absent_from(pieces: list[str], texts: list[str]) -> list[str]:
    """The pieces found verbatim in none of `texts`.

    The standard library repeats code between modules (site.py and sysconfig.py share their
    user-base lookup), so whole-file splits alone still let a held-out piece be trained on.
    """
    joined = "\0".join(texts)
    return [piece for piece in pieces if piece not in joined]


def training_threads() -> int:
    """Two, or fewer where the worker may use fewer CPUs (see the module docstring)."""
    return min(TRAINING_THREADS, usable_cpus()[0])


def _key(spec: YardstickSpec) -> dict:
    """What the built folder depends on: a change to any of it rebuilds."""
    import torch
    import transformers

    return {
        "spec": asdict(spec),
        "threads": training_threads(),
        "python": platform.python_version(),  # the corpus is this interpreter's own library
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "code": file_sha256(Path(__file__)).hex(),
    }


def _write_jsonl(path: Path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def perplexity(model, tokenizer, texts: list[str], max_len: int) -> float:
    """Perplexity over every next-token position of `texts`, each cut to `max_len` tokens, scored
    as the flows score (compressflow.evaluation.quality.perplexity)."""
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return quality.perplexity(model, [ids[:max_len] for ids in encoded])


def _train(spec: YardstickSpec, tokenizer, train_texts: list[str]):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    moe = (
        # The router's load-balancing loss keeps every expert in use: experts the router never
        # picks would make pruning them free, and the yardstick blind.
        dict(
            num_local_experts=spec.experts,
            num_experts_per_tok=spec.experts_per_token,
            output_router_logits=True,
            router_aux_loss_coef=0.01,
        )
        if spec.experts
        else {}
    )
    config = (MixtralConfig if spec.experts else LlamaConfig)(
        **moe,
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=2048,
        initializer_range=spec.init_std,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    model = (MixtralForCausalLM if spec.experts else LlamaForCausalLM)(config).to(torch.float32)
    encoded = tokenizer.backend_tokenizer.encode_batch(train_texts, add_special_tokens=False)
    stream = torch.tensor([i for e in encoded for i in [*e.ids, tokenizer.eos_token_id]])
    # No weight decay: it would pull the weights back toward the small-range ones that made
    # quantization invisible.
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=spec.learning_rate, betas=(0.9, 0.95), weight_decay=0.0
    )
    generator = torch.Generator().manual_seed(spec.seed)
    model.train()
    loss = torch.tensor(0.0)
    for step in range(spec.steps):
        warmup = min(1.0, (step + 1) / spec.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * step / spec.steps))
        for group in optimizer.param_groups:
            group["lr"] = spec.learning_rate * warmup * cosine
        starts = torch.randint(
            0, len(stream) - spec.seq_len, (spec.batch_size,), generator=generator
        )
        batch = torch.stack([stream[s : s + spec.seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.config.output_router_logits = False  # saved as any Mixtral checkpoint: no aux loss
    return model.eval(), loss.item()


def build_yardstick(root: str | Path, spec: YardstickSpec = YardstickSpec()) -> Yardstick:
    """Build the yardstick under `root` (yardstick-llama/ or, for a spec with experts,
    yardstick-mixtral/; calibration.jsonl, held_out.jsonl), or reuse it. A `root` holding
    anything else is refused: building writes over those names.

    Processes that ask for one `root` at once (the demo, test sessions, pytest-xdist's workers)
    take turns: the first builds, the others wait and reuse it.
    """
    import fcntl

    root = Path(root)
    others = sorted(p.name for p in root.iterdir() if p.name not in OURS) if root.is_dir() else []
    if others:
        raise FileExistsError(
            f"{root} holds files the yardstick did not write ({', '.join(others[:3])}); give it "
            "an empty or new folder"
        )
    root.mkdir(parents=True, exist_ok=True)
    with open(root / LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _reuse(root, spec) or _build(root, spec)


def _build(root: Path, spec: YardstickSpec) -> Yardstick:
    import torch

    model_dir = root / spec.model_dir
    marker = model_dir / SPEC_FILE
    # An older build's marker (`_reuse` read it as a build's) stays valid for its own key while
    # this one writes over its files.
    marker.unlink(missing_ok=True)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / BUILDING).touch()  # the folder is ours from here, should this build crash
    wall, cpu = time.perf_counter(), time.process_time()
    threads = torch.get_num_threads()
    torch.set_num_threads(training_threads())
    try:
        train_files, held_out_files = corpus_files(spec)
        train_texts, held_out_texts = _read(train_files), _read(held_out_files)
        tokenizer = build_tokenizer(spec.vocab_size, train_texts)  # the training split only
        model, final_loss = _train(spec, tokenizer, train_texts)
        held_out = _absent_from(windows(tokenizer, held_out_texts, spec.seq_len), train_texts)
        calibration = _absent_from(windows(tokenizer, train_texts, spec.seq_len), held_out_texts)
        # An even spread over the training files, not the first files' pieces only.
        count = min(spec.calibration_texts, len(calibration))
        calibration = [calibration[i * len(calibration) // count] for i in range(count)]
        base_ppl = perplexity(model, tokenizer, held_out, spec.seq_len)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    _write_jsonl(root / "calibration.jsonl", calibration)
    _write_jsonl(root / "held_out.jsonl", held_out)
    built = {
        "wall_seconds": round(time.perf_counter() - wall, 1),
        "cpu_seconds": round(time.process_time() - cpu, 1),
        "final_train_loss": round(final_loss, 4),
        "held_out_perplexity": round(base_ppl, 4),
        "held_out_texts": len(held_out),
        "held_out_files": [f.name for f in held_out_files],
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    # Written last, whole or not at all: its presence means the folder is complete.
    text = json.dumps({**_key(spec), "built": built}, indent=1)
    write_atomic(marker, lambda path: path.write_text(text))
    (model_dir / BUILDING).unlink()
    return Yardstick(model_dir, root / "calibration.jsonl", root / "held_out.jsonl", spec, built)


def _reuse(root: Path, spec: YardstickSpec) -> Yardstick | None:
    """The build under `root` when its key is `spec`'s; a marker no build wrote is refused."""
    marker = root / spec.model_dir / SPEC_FILE
    if not marker.exists():
        model_dir = marker.parent
        # Neither a finished build nor a crashed one (BUILDING) wrote it: a build would write its
        # weights, config and tokenizer over what is there.
        if model_dir.is_dir() and any(model_dir.iterdir()) and not (model_dir / BUILDING).exists():
            raise FileExistsError(
                f"{model_dir} was not written by a yardstick build; give the yardstick an empty "
                "or new folder"
            )
        return None
    try:
        recorded = json.loads(marker.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError):
        recorded = None
    if not isinstance(recorded, dict) or "built" not in recorded:
        raise FileExistsError(
            f"{marker} was not written by a yardstick build; give the yardstick an empty or new "
            "folder"
        )
    built = recorded.pop("built")
    if recorded != _key(spec):
        return None
    return Yardstick(
        marker.parent, root / "calibration.jsonl", root / "held_out.jsonl", spec, built
    )


if __name__ == "__main__":
    paths = [a for a in sys.argv[1:] if a != "--moe"]
    spec = MOE_SPEC if "--moe" in sys.argv[1:] else YardstickSpec()
    built = build_yardstick(paths[0] if paths else "yardstick", spec)
    print(json.dumps({"model": str(built.model), **built.built}, indent=1))
