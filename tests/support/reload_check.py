"""Reload a published checkpoint in a fresh process, as a server would, and compare it with
its base model; prints one JSON line. Tests call `assert_published_model_matches_base`, which
runs it:

    python tests/support/reload_check.py PUBLISHED BASE MODEL_CLASS

A fresh process matters: state llm-compressor leaves in the calibrating process (patched
modules, registries) can make a reload there behave differently.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
import transformers

from compressflow.compat import patch_reloads
from compressflow.data.local_text import python_docs


def logits(model, texts: list[list[int]]) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [model(torch.tensor([ids])).logits[0].float() for ids in texts]


def main(published: str, base: str, class_name: str) -> dict:
    patch_reloads()  # the pinned transformers' reload bugs; a server has its own loader
    cls = getattr(transformers, class_name)
    compressed, info = cls.from_pretrained(published, output_loading_info=True)
    config = json.loads(open(f"{published}/config.json").read())
    quant = config.get("quantization_config") or config["text_config"]["quantization_config"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(published)
    # Text the verify stage never saw (it reads builtins' docstrings).
    texts = [tokenizer(doc)["input_ids"][:48] for doc in python_docs()[100:103]]
    base_logits = logits(cls.from_pretrained(base).eval(), texts)
    new_logits = logits(compressed.eval(), texts)
    pairs = list(zip(base_logits, new_logits, strict=True))
    return {
        "load_problems": {k: list(map(str, info[k])) for k in info if info[k]},
        "format": quant["format"],
        "cosine": torch.cat([torch.cosine_similarity(b, n, dim=-1) for b, n in pairs])
        .mean()
        .item(),
        "top1": torch.cat([b.argmax(-1) == n.argmax(-1) for b, n in pairs]).float().mean().item(),
    }


def assert_published_model_matches_base(published: Path, base: Path, cls_name: str) -> None:
    """Reload what was published in a fresh process and compare it with the base model."""
    done = subprocess.run(
        [sys.executable, __file__, str(published), str(base), cls_name],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert not result["load_problems"], result
    assert result["format"] != "dense", result
    assert result["cosine"] > 0.9 and result["top1"] > 0.35, result


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4])))
