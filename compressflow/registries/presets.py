"""Preset recipes: the named recipes a user can pass as `recipe` instead of writing YAML.

Plain data only, so the registry can be listed in docs, the CLI and the UI without importing
llm-compressor. Each preset is a YAML template whose `$name` placeholders all have a default and a
one-line doc; `recipe_args` override the defaults. `tasks.render_recipe` renders and validates them.

Beside the recipe, each preset records what an engineer picks it by: the GPUs vLLM serves it on
(vLLM's quantization docs and its compressed-tensors scheme selection), whether it calibrates on
data, and whether the whole flow runs it on a CPU-only worker here. That last one is measured
(llm-compressor 0.14.0.1, compressed-tensors 0.19, CPU torch 2.13) on the tiny Llama, and
`tests/matrix/test_cpu_presets.py` keeps it true: each CPU preset is compressed, verified and reloaded there.

Every preset takes `kv_cache_scheme`: null (the default) leaves the KV cache in the model's dtype;
`fp8` names `KV_CACHE_FP8` (`recipe.kv_cache: fp8` sets it too). KV scales are calibrated, so with
it a data-free preset needs samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from compressflow.errors import RecipeError


@dataclass(frozen=True)
class Placeholder:
    default: Any
    doc: str
    # Names for long values (`fp8` for a whole KV-cache scheme): the UI's recipe_args is free
    # JSON, and a name is easier to type, and to sweep over, than a nested mapping.
    named: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Preset:
    description: str
    template: str
    placeholders: dict[str, Placeholder] = field(default_factory=dict)
    # Where vLLM serves the checkpoint, by NVIDIA compute capability.
    vllm_gpus: str = ""
    # Whether calibration needs samples; tests check render's `needs_data` agrees.
    needs_data: bool = True
    # Whether the flow runs it on a CPU-only worker; if not, the error it gives there.
    cpu_ok: bool = True
    why_gpu_only: str = ""
    # What a user must know beyond the description, measured here.
    caveat: str = ""

    def __post_init__(self):
        if self.cpu_ok == bool(self.why_gpu_only):
            raise ValueError("a preset is cpu_ok, or GPU-only with why_gpu_only saying why")

    def defaults(self) -> dict[str, Any]:
        return {name: p.default for name, p in self.placeholders.items()}

    @property
    def data(self) -> str:
        return "calibration samples" if self.needs_data else "data-free"

    @property
    def what(self) -> str:
        return f"{self.description} {self.caveat}".strip()


# The FP8 KV cache as llm-compressor's examples write it (examples/quantization_kv_cache): one
# static scale per tensor for keys and one for values, which vLLM reads with kv_cache_dtype fp8.
KV_CACHE_FP8: dict[str, Any] = {
    "num_bits": 8,
    "type": "float",
    "strategy": "tensor",
    "dynamic": False,
    "symmetric": True,
}
# The KV-cache schemes by name: `recipe.kv_cache` and the kv_cache_scheme placeholder take these.
KV_CACHE_SCHEMES: dict[str, dict[str, Any]] = {"fp8": KV_CACHE_FP8}

_IGNORE = Placeholder(["lm_head"], "Module names or `re:` patterns left unquantized")
_DAMPENING = Placeholder(0.01, "GPTQ Hessian dampening, as a fraction of its mean diagonal")
_BLOCK_SIZE = Placeholder(128, "Columns GPTQ quantizes per block; memory against speed")
_KV_CACHE = Placeholder(
    None,
    "KV-cache quantization: null (off), fp8 (per-tensor FP8, scales calibrated on the samples), "
    "or a compressed-tensors QuantizationArgs mapping",
    named=KV_CACHE_SCHEMES,
)

# vLLM's kernels: Marlin serves int4 and weight-only FP8/FP4 from Ampere; FP8 compute needs
# Ada/Hopper, FP4 compute Blackwell (elsewhere vLLM falls back to weight-only FP4 Marlin).
_MARLIN = "Ampere (sm80)+ via Marlin"
_FP4 = "Blackwell (sm100)+; older GPUs weight-only via FP4 Marlin"
# compressed-tensors 0.19 unpacks FP4 weights as bf16 whatever the model's dtype: verify's reload
# of a float32 model fails with "expected m1 and m2 to have the same dtype, but got: float !=
# c10::BFloat16"; a bf16 copy of the same model passes (vLLM has its own loader).
_FP4_RELOAD = (
    "Needs a bf16 or fp16 source model: a float32 one is refused before weights load "
    "(compressed-tensors unpacks FP4 as bf16)."
)


def _stage(*modifiers: str) -> str:
    """One quantization stage holding `modifiers` (each a YAML block at modifier depth)."""
    return "quant_stage:\n  quant_modifiers:\n" + "".join(modifiers)


def _gptq(scheme: str) -> str:
    return f"""\
    GPTQModifier:
      targets: Linear
      scheme: {scheme}
      ignore: $ignore
      dampening_frac: $dampening_frac
      block_size: $block_size
      kv_cache_scheme: $kv_cache_scheme
"""


def _quantization(scheme: str) -> str:
    """Round-to-nearest (QuantizationModifier): the data-free and FP4 schemes."""
    return f"""\
    QuantizationModifier:
      targets: Linear
      scheme: {scheme}
      ignore: $ignore
      kv_cache_scheme: $kv_cache_scheme
"""


# The QuIP preset's Hadamard block: a power of two, equal to W4A16's group size, so the layers
# the rotation refuses are the ones group quantization refuses too.
QUIP_BLOCK = 128

_GPTQ_ARGS = {
    "ignore": _IGNORE,
    "dampening_frac": _DAMPENING,
    "block_size": _BLOCK_SIZE,
    "kv_cache_scheme": _KV_CACHE,
}
_QUANTIZATION_ARGS = {"ignore": _IGNORE, "kv_cache_scheme": _KV_CACHE}


# Keys are the canonical names; `preset_named` finds them in any case.
PRESETS: dict[str, Preset] = {
    "W4A16": Preset(
        description="GPTQ int4 weights (groups of 128), 16-bit activations.",
        template=_stage(_gptq("W4A16")),
        placeholders=_GPTQ_ARGS,
        vllm_gpus=_MARLIN,
    ),
    "W4A16_AWQ": Preset(
        description="AWQ activation-aware scales, then int4 weights with zero points (groups of "
        "128); for models GPTQ loses accuracy on.",
        # Asymmetric, as llm-compressor's AWQ examples: scaled weights have skewed ranges.
        template="""\
quant_stage:
  quant_modifiers:
    AWQModifier:
      n_grid: $n_grid
    QuantizationModifier:
      targets: Linear
      scheme: W4A16_ASYM
      ignore: $ignore
      kv_cache_scheme: $kv_cache_scheme
""",
        placeholders={
            "n_grid": Placeholder(20, "Scales AWQ tries per layer; more is slower"),
            "ignore": _IGNORE,
            "kv_cache_scheme": _KV_CACHE,
        },
        vllm_gpus=_MARLIN,
        cpu_ok=False,
        why_gpu_only="AWQ pins memory: 'Cannot access accelerator device' on CPU torch; refused "
        "before the model loads",
    ),
    "W4A16_AUTOROUND": Preset(
        description="AutoRound (rounding and clipping tuned by signed gradient descent, layer by "
        "layer), int4 weights (groups of 128); for models GPTQ loses accuracy on.",
        template="""\
quant_stage:
  quant_modifiers:
    AutoRoundModifier:
      targets: Linear
      scheme: W4A16
      ignore: $ignore
      iters: $iters
      kv_cache_scheme: $kv_cache_scheme
""",
        placeholders={
            "ignore": _IGNORE,
            # Measured on CPU: 200 steps took 190 s on the 2-layer tiny Llama, 20 took 35 s.
            "iters": Placeholder(200, "Tuning steps per decoder layer; time grows with it"),
            "kv_cache_scheme": _KV_CACHE,
        },
        vllm_gpus=_MARLIN,
    ),
    "W4A16_QUIP": Preset(
        description="QuIP input rotations (Hadamard blocks of 128, online in the served model), "
        "then GPTQ int4 weights (groups of 128); rotated weights have fewer outliers to round.",
        # llm-compressor's examples/transform/quip_example.py: QuIPModifier(transform_block_size=
        # 128, transform_type="hadamard") (v rotations only, its default), then W4A16; GPTQ in
        # place of its round-to-nearest, as the issue that asked for the preset. Hadamard of a
        # power-of-two size, so vLLM's hadacore kernel applies it; the rotation shares `ignore`
        # with GPTQ: a layer left in 16 bits gains nothing from a rotation it pays for online.
        template=f"""\
quant_stage:
  quant_modifiers:
    QuIPModifier:
      rotations: [v]
      transform_type: hadamard
      transform_block_size: {QUIP_BLOCK}
      targets: Linear
      ignore: $ignore
{_gptq("W4A16")}""",
        placeholders=_GPTQ_ARGS,
        vllm_gpus=_MARLIN + "; the rotations need vLLM's online Hadamard transforms",
        caveat="Every rotated layer's input width must be a multiple of 128 (refused before "
        "calibration otherwise).",
    ),
    "W8A8": Preset(
        description="SmoothQuant then GPTQ: int8 weights (per channel), dynamic int8 activations "
        "(per token).",
        template=_stage(
            "    SmoothQuantModifier:\n      smoothing_strength: $smoothing_strength\n",
            _gptq("W8A8"),
        ),
        placeholders={
            "smoothing_strength": Placeholder(
                0.8, "How much activation outlier range SmoothQuant moves into the weights (0-1)"
            ),
            **_GPTQ_ARGS,
        },
        vllm_gpus="Turing to Hopper (sm75-sm90)",
    ),
    "W8A8_GPTQ": Preset(
        description="GPTQ int8 weights (per channel), dynamic int8 activations (per token), no "
        "SmoothQuant; for families SmoothQuant has no mapping for.",
        template=_stage(_gptq("W8A8")),
        placeholders=_GPTQ_ARGS,
        vllm_gpus="Turing to Hopper (sm75-sm90)",
    ),
    "FP8_DYNAMIC": Preset(
        description="FP8 weights (per channel), dynamic FP8 activations (per token).",
        template=_stage(_quantization("FP8_DYNAMIC")),
        placeholders=_QUANTIZATION_ARGS,
        vllm_gpus="Ada/Hopper (sm89/sm90)+; Ampere (sm80) weight-only via FP8 Marlin",
        needs_data=False,
    ),
    "FP8_BLOCK": Preset(
        description="FP8 weights in 128x128 blocks, dynamic FP8 activations in groups of 128 "
        "(DeepSeek-V3 style).",
        template=_stage(_quantization("FP8_BLOCK")),
        placeholders=_QUANTIZATION_ARGS,
        vllm_gpus="Ada/Hopper (sm89/sm90)+",
        needs_data=False,
    ),
    "NVFP4A16": Preset(
        description="NVFP4 weights (FP4 in groups of 16, FP8 scales), 16-bit activations.",
        template=_stage(_quantization("NVFP4A16")),
        placeholders=_QUANTIZATION_ARGS,
        vllm_gpus="Ampere (sm80)+ via FP4 Marlin",
        needs_data=False,
        caveat=_FP4_RELOAD,
    ),
    "NVFP4": Preset(
        description="NVFP4 weights and activations (FP4 in groups of 16, FP8 scales); activation "
        "global scales are calibrated.",
        template=_stage(_quantization("NVFP4")),
        placeholders=_QUANTIZATION_ARGS,
        vllm_gpus=_FP4,
        caveat=_FP4_RELOAD,
    ),
    "MXFP4": Preset(
        description="MXFP4 weights and dynamic activations (FP4 in groups of 32, power-of-two "
        "scales: OCP microscaling).",
        template=_stage(_quantization("MXFP4")),
        placeholders=_QUANTIZATION_ARGS,
        vllm_gpus=_FP4,
        needs_data=False,
        caveat=_FP4_RELOAD,
    ),
    "W4AFP8": Preset(
        description="GPTQ int4 weights (groups of 128), dynamic FP8 activations (per token).",
        # compressed-tensors' W4AFP8 scheme written out only to add `format`: the preset name
        # saves int4 unpacked in int8 (`int-quantized`), and vLLM's W4A8-FP8 kernel reads packed.
        template="""\
quant_stage:
  quant_modifiers:
    GPTQModifier:
      config_groups:
        group_0:
          targets: [Linear]
          format: pack-quantized
          weights: {num_bits: 4, type: int, strategy: group, group_size: 128, symmetric: true}
          input_activations: {num_bits: 8, type: float, strategy: token, symmetric: true,
            dynamic: true}
      ignore: $ignore
      dampening_frac: $dampening_frac
      block_size: $block_size
      kv_cache_scheme: $kv_cache_scheme
""",
        placeholders=_GPTQ_ARGS,
        # vLLM matches its W4A8-FP8 CUTLASS kernel on sm90 exactly.
        vllm_gpus="Hopper (sm90)",
    ),
}


def preset_named(name: str) -> str | None:
    """The preset called `name` in any case, `-` or `_` alike (`fp8-dynamic` is FP8_DYNAMIC)."""
    key = name.strip().upper().replace("-", "_")
    return key if key in PRESETS else None


def resolve_args(preset_name: str, values: dict[str, Any]) -> dict[str, Any]:
    """`values` with each name a placeholder knows (`kv_cache_scheme: fp8`) replaced by its value.

    A string a named placeholder does not know is refused here: passed on, it would reach
    llm-compressor's parser and fail there with a message that does not list the names.
    """
    placeholders = PRESETS[preset_name].placeholders
    resolved = dict(values)
    for name, value in values.items():
        named = placeholders[name].named if name in placeholders else {}
        if not named or not isinstance(value, str):
            continue
        key = value.strip().lower()
        if key not in named:
            raise RecipeError(
                "recipe.recipe_args",
                f"{name} is {value!r}, a name preset {preset_name} does not know",
                f"use {' or '.join(named)}, null, or a full mapping ({placeholders[name].doc})",
            )
        resolved[name] = named[key]
    return resolved


def preset_rows() -> list[dict[str, str]]:
    """One row per preset, in registry order, for `compressflow presets` and the preset table in docs/recipes.md."""
    return [
        {
            "preset": name,
            "what": preset.what,
            "placeholders": ", ".join(f"{k}={v!r}" for k, v in preset.defaults().items()),
            "data": preset.data,
            "vllm_gpus": preset.vllm_gpus,
            "cpu_worker": "yes" if preset.cpu_ok else f"no: {preset.why_gpu_only}",
        }
        for name, preset in PRESETS.items()
    ]


# The "## Recipes" table of docs/recipes.md: its column headers and the preset_rows() key each shows.
TABLE_COLUMNS = {
    "preset": "preset",
    "what": "what",
    "data": "data",
    "vLLM runs it on": "vllm_gpus",
    "CPU worker here": "cpu_worker",
}


def markdown_table() -> str:
    """docs/recipes.md's preset table, generated from the registry (tests compare the two)."""
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    for row in preset_rows():
        cells = [row[key].replace("|", "\\|") for key in TABLE_COLUMNS.values()]
        cells[0] = f"`{cells[0]}`"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
