"""Per-architecture rules that make the presets produce correct checkpoints: plain data.

Keyed by `config.json`'s `model_type`. The adapt-recipe stage applies a rule to the rendered
recipe (ignore patterns, SmoothQuant mappings) and calibration applies the checkpoint renames
before saving. What llm-compressor already does right for a family needs no entry; every entry
says why it exists and has a test in tests/unit/test_architecture_rules.py.

Measured on tiny random-weight models of each family (llm-compressor 0.14.0.1, transformers 5.17).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# SmoothQuant mappings as llm-compressor takes them: [[balance layers...], smoothed layer].
Mapping = tuple[tuple[str, ...], str]

# Smoothing the attention input only: one vector folds into q/k/v, never into a router or experts.
ATTENTION_INPUT: tuple[Mapping, ...] = (
    (("re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"), "re:.*input_layernorm$"),
)


@dataclass(frozen=True)
class Architecture:
    """What a family needs beyond llm-compressor's defaults."""

    why: str = field(metadata={"help": "The failure this rule prevents, as measured."})
    ignore: tuple[str, ...] = field(
        default=(), metadata={"help": "Added to every quantization modifier's ignore list."}
    )
    smoothquant: tuple[Mapping, ...] | None = field(
        default=None,
        metadata={
            "help": "SmoothQuant mappings to use when the recipe gives none; None keeps "
            "llm-compressor's own choice."
        },
    )
    no_smoothquant: str = field(
        default="",
        metadata={
            "help": "Why no SmoothQuant mapping fits this family: when set, SmoothQuant is "
            "removed from the recipe (the rest of it, e.g. GPTQ W8A8, still runs)."
        },
    )
    sequential_targets: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "Decoder layer classes calibrated one at a time, when the user names none "
            "(a vision-language model's default would take in the vision tower)."
        },
    )
    smoothquant_when: tuple[tuple[tuple[tuple[str, object], ...], tuple[Mapping, ...]], ...] = (
        field(
            default=(),
            metadata={
                "help": "((config key, value) pairs, mappings): the first whose pairs all hold in "
                "config.json replaces `smoothquant` (one family, several layer layouts)."
            },
        )
    )
    linear_classes: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "nn.Linear subclasses with Linear's own forward: calibrated as plain "
            "nn.Linear, since compressed-tensors saves unknown subclasses unpacked (dense), and "
            "leaves one that stays unquantized off the saved ignore list, so the reload "
            "quantizes it (a `Linear` target matches subclasses)."
        },
    )
    expert_renames: tuple[tuple[str, str], ...] = field(
        default=(),
        metadata={
            "help": "(checkpoint name, calibrated name) regexes: the source checkpoint's expert "
            "names, which llm-compressor's per-expert Linears must be saved under."
        },
    )


# A vision-language model's text schemes quantize its language model only.
_LANGUAGE = r"re:.*language_model\.layers\.\d+"
LANGUAGE_MODEL: tuple[Mapping, ...] = (
    (
        (
            _LANGUAGE + r"\.self_attn\.q_proj$",
            _LANGUAGE + r"\.self_attn\.k_proj$",
            _LANGUAGE + r"\.self_attn\.v_proj$",
        ),
        _LANGUAGE + r"\.input_layernorm$",
    ),
    (
        (_LANGUAGE + r"\.mlp\.gate_proj$", _LANGUAGE + r"\.mlp\.up_proj$"),
        _LANGUAGE + r"\.post_attention_layernorm$",
    ),
)
# The vision tower and projector are left unquantized for every vision-language model, found on
# the meta model (tasks/adapt_recipe.py), not listed here.
_VISION_WHY = (
    "the preset's plain `lm_head` misses an output head nested in the language model "
    "(transformers 4's `language_model.lm_head`), and llm-compressor's default SmoothQuant "
    "mappings match the vision encoder's layers too"
)

# Gemma's MLP reads pre_feedforward_layernorm; post_attention_layernorm normalizes the attention
# output, so llm-compressor's default mapping smooths the wrong norm (logits destroyed).
GEMMA: tuple[Mapping, ...] = (
    ATTENTION_INPUT[0],
    (("re:.*mlp\\.gate_proj$", "re:.*mlp\\.up_proj$"), "re:.*pre_feedforward_layernorm$"),
)
_FALCON_QKV, _FALCON_MLP = "re:.*self_attention\\.query_key_value$", "re:.*mlp\\.dense_h_to_4h$"

# nn.Linear subclasses every family calibrates as plain nn.Linear (`linear_classes` adds a
# family's own). torch's nn.MultiheadAttention keeps its out_proj as this one (a SigLIP tower's
# attention-pool head, Gemma 3's and PaliGemma's): left unquantized with the tower, it was saved
# off the ignore list and the reload quantized it ("'NonDynamicallyQuantizableLinear' object has
# no attribute 'weight'": MultiheadAttention reads out_proj.weight itself).
PLAIN_LINEAR_EVERYWHERE = ("NonDynamicallyQuantizableLinear",)

ARCHITECTURES: dict[str, Architecture] = {
    "gemma2": Architecture(
        why="SmoothQuant with the default mappings destroyed the logits (cosine 0.37, top-1 1%)",
        smoothquant=GEMMA,
    ),
    "gemma3_text": Architecture(
        why="SmoothQuant with the default mappings destroyed the logits (cosine 0.3)",
        smoothquant=GEMMA,
    ),
    "gpt_neox": Architecture(
        why="no default SmoothQuant mapping matches its fused query_key_value layers",
        smoothquant=(
            (("re:.*attention\\.query_key_value$",), "re:.*input_layernorm$"),
            (("re:.*mlp\\.dense_h_to_4h$",), "re:.*post_attention_layernorm$"),
        ),
    ),
    "falcon": Architecture(
        why="FalconLinear (an nn.Linear subclass) was saved unpacked as format dense, the size "
        "of the original; no default SmoothQuant mapping matches its layers",
        # Falcon-7B layout: one input_layernorm feeds attention and MLP in parallel.
        smoothquant=(((_FALCON_QKV, _FALCON_MLP), "re:.*input_layernorm$"),),
        smoothquant_when=(
            (  # Falcon-40B/180B: separate norms for the parallel attention and MLP
                (("new_decoder_architecture", True), ("num_ln_in_parallel_attn", 2)),
                (((_FALCON_QKV,), "re:.*ln_attn$"), ((_FALCON_MLP,), "re:.*ln_mlp$")),
            ),
            (
                (("new_decoder_architecture", True), ("num_ln_in_parallel_attn", None)),
                (((_FALCON_QKV,), "re:.*ln_attn$"), ((_FALCON_MLP,), "re:.*ln_mlp$")),
            ),
            (
                (("new_decoder_architecture", False), ("parallel_attn", False)),
                (
                    ((_FALCON_QKV,), "re:.*input_layernorm$"),
                    ((_FALCON_MLP,), "re:.*post_attention_layernorm$"),
                ),
            ),
        ),
        linear_classes=("FalconLinear",),
    ),
    "olmo2": Architecture(
        why="no SmoothQuant mapping fits: llm-compressor's default failed to resolve",
        no_smoothquant="OLMo2 normalizes after attention and MLP, so no norm precedes q/k/v or "
        "gate/up to fold smoothing scales into",
    ),
    "mixtral": Architecture(
        why="experts were saved as experts.N.gate_proj/up_proj/down_proj; the source "
        "checkpoint (and vLLM) name them w1/w3/w2, so reload initialised them at random",
        ignore=("re:.*block_sparse_moe\\.gate$", "re:.*mlp\\.gate$"),
        smoothquant=ATTENTION_INPUT,
        expert_renames=(
            (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
            (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
            (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
        ),
    ),
    "qwen2_moe": Architecture(
        why="mlp.shared_expert_gate (a Linear to 1 output) was quantized; vLLM builds it "
        "unquantized",
        ignore=("re:.*mlp\\.gate$", "re:.*shared_expert_gate$"),
        smoothquant=ATTENTION_INPUT,
    ),
    "qwen3_moe": Architecture(
        why="routers stay unquantized; SmoothQuant smooths attention inputs only",
        ignore=("re:.*mlp\\.gate$",),
        smoothquant=ATTENTION_INPUT,
    ),
    "deepseek_v3": Architecture(
        why="routers stay unquantized; attention is MLA (q_a_proj / kv_a_proj_with_mqa)",
        ignore=("re:.*mlp\\.gate$",),
        smoothquant=((("re:.*q(_a)?_proj$", "re:.*kv_a_proj_with_mqa$"), "re:.*input_layernorm$"),),
    ),
    "llava": Architecture(
        why=_VISION_WHY,
        ignore=("re:.*lm_head$",),
        smoothquant=LANGUAGE_MODEL,
        sequential_targets=("LlamaDecoderLayer",),
    ),
    "qwen2_5_vl": Architecture(
        why=_VISION_WHY,
        ignore=("re:.*lm_head$",),
        smoothquant=LANGUAGE_MODEL,
        sequential_targets=("Qwen2_5_VLDecoderLayer",),
    ),
    "mllama": Architecture(
        why=_VISION_WHY + "; cross-attention layers read image states, which text calibration "
        "never feeds, so they stay unquantized",
        ignore=("re:.*lm_head$", "re:.*cross_attn.*"),
        no_smoothquant="Mllama interleaves cross-attention decoder layers whose norms feed only "
        "cross-attention, so one mapping cannot cover every language-model layer",
        sequential_targets=("MllamaSelfAttentionDecoderLayer", "MllamaCrossAttentionDecoderLayer"),
    ),
    "gemma3": Architecture(
        why=_VISION_WHY + "; Gemma3's MLP reads pre_feedforward_layernorm, not "
        "post_attention_layernorm",
        ignore=("re:.*lm_head$",),
        smoothquant=(
            LANGUAGE_MODEL[0],
            (LANGUAGE_MODEL[1][0], _LANGUAGE + r"\.pre_feedforward_layernorm$"),
        ),
        sequential_targets=("Gemma3DecoderLayer",),
    ),
}
