"""The memory plan's inputs: the shape of a real 8B model, its config and folder, and a made-up
calibration dataset (unit tests of the plan, and the calibration runs' batch sizes)."""

from __future__ import annotations

from compressflow.model.memory import Shape
from compressflow.results import BuiltDataset, FetchedModel

# Llama-3.1-8B: 8.03e9 parameters, bfloat16; a decoder layer holds 218M parameters (q/o 4096^2,
# k/v 4096x1024, gate/up/down 4096x14336), whose Hessians are 4 x 4096^2 + 2 x 4096^2 (q, k, v,
# o, gate, up read 4096 wide) + 14336^2 (down) float32 elements.
LLAMA_8B = Shape(
    parameters=8_030_261_248,
    hidden=4096,
    intermediate=14336,
    heads=32,
    largest_layer=218_112_000,
    largest_state=6 * 4096**2 + 14336**2,
    largest_module=4096 * 14336,
    quantizable=frozenset(),
    not_linear=frozenset(),
)
BF16_BYTES = 2 * LLAMA_8B.parameters


class Config:
    dtype = "bfloat16"

    def get_text_config(self):
        return self


def model_8b(tmp_path) -> FetchedModel:
    return FetchedModel(
        path=str(tmp_path),  # no weight files: sizes come from the config's dtype
        source="local",
        model_id="meta-llama/Llama-3.1-8B",
        identity="llama-8b",
        size_bytes=BF16_BYTES,
        parameters=LLAMA_8B.parameters,
        trust_remote_code=False,
        model_class="AutoModelForCausalLM",
    )


def data(samples: int = 256, tokens: int = 2048) -> BuiltDataset:
    return BuiltDataset(
        path="/nonexistent",
        fingerprint="f",
        source="test",
        num_samples=samples,
        token_stats={"min": tokens, "mean": tokens, "max": tokens, "total": samples * tokens},
        chat_template_applied=False,
    )
