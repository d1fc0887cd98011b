"""Tiny random-weight models of the architectures people bring, built from configs, no hub.

Each entry is a real transformers architecture (dense, MoE, vision-language) shrunk to two
layers, with widths that are multiples of 128 so W4A16's groups fit. The architecture matrix in
tests/matrix/test_architectures.py compresses every one with the presets and proves what is
published; `build_tiny(name, root)` writes a model folder (config, safetensors, tokenizer or
processor) once and reuses it.

Random weights give near-uniform logits, so the lm_head is scaled up: top-1 agreement between a
model and its compressed copy then means something. A tied model (Gemma2) gets its final norm
scaled instead: scaling its head would scale its embeddings too, and it would only ever predict
the token it was given.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compressflow.demo.assets import build_tokenizer

VOCAB = 1024
DENSE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
MOE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
TEXT = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)

# Special tokens each vision-language processor looks up in its tokenizer.
VISION_TOKENS = {
    "llava": {"image_token": "<image>"},
    "qwen2_5_vl": {
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
        "vision_start_token": "<|vision_start|>",
        "vision_end_token": "<|vision_end|>",
    },
    "mllama": {"image_token": "<|image|>", "python_token": "<|python_tag|>"},
    "gemma3": {
        "boi_token": "<start_of_image>",
        "image_token": "<image_soft_token>",
        "eoi_token": "<end_of_image>",
    },
}


def vision_chat_template(image: str) -> str:
    """The demo chat template, with `image` where a message's content holds an image."""
    return (
        "{% for message in messages %}<|{{ message['role'] }}|>\n"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for item in message['content'] %}{% if item['type'] == 'image' %}" + image + "\n"
        "{% else %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )


@dataclass(frozen=True)
class Tiny:
    """One architecture: its config and model classes, and the config's arguments."""

    family: str  # dense | moe | vision
    config: str
    model: str
    kwargs: dict[str, Any]
    model_class: str = "AutoModelForCausalLM"  # what compress-model's model.model_class needs


ZOO: dict[str, Tiny] = {
    "llama": Tiny("dense", "LlamaConfig", "LlamaForCausalLM", DENSE),
    "qwen2": Tiny("dense", "Qwen2Config", "Qwen2ForCausalLM", DENSE),
    "qwen3": Tiny("dense", "Qwen3Config", "Qwen3ForCausalLM", {**DENSE, "head_dim": 64}),
    "mistral": Tiny("dense", "MistralConfig", "MistralForCausalLM", {**DENSE, "head_dim": 64}),
    "phi3": Tiny("dense", "Phi3Config", "Phi3ForCausalLM", DENSE),
    "granite": Tiny("dense", "GraniteConfig", "GraniteForCausalLM", DENSE),
    "stablelm": Tiny("dense", "StableLmConfig", "StableLmForCausalLM", DENSE),
    "gemma2": Tiny(
        "dense",
        "Gemma2Config",
        "Gemma2ForCausalLM",
        # Tied, as every released Gemma2: vLLM's Gemma2 has no lm_head of its own and refuses a
        # checkpoint that carries one (base model included).
        {
            **DENSE,
            "head_dim": 64,
            "query_pre_attn_scalar": 64,
            "sliding_window": 32,
            "tie_word_embeddings": True,
        },
    ),
    "gemma3_text": Tiny(
        "dense",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {**DENSE, "head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 32},
    ),
    "falcon": Tiny(
        "dense",
        "FalconConfig",
        "FalconForCausalLM",
        # The MLP 4x as wide as the model, as every released Falcon: vLLM's Falcon assumes it
        # (it reads no ffn_hidden_size).
        {"hidden_size": 256, "ffn_hidden_size": 1024, "num_attention_heads": 4},
    ),
    "gpt_neox": Tiny(
        "dense",
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4},
    ),
    "olmo2": Tiny("dense", "Olmo2Config", "Olmo2ForCausalLM", DENSE),
    "mixtral": Tiny(
        "moe",
        "MixtralConfig",
        "MixtralForCausalLM",
        {
            **MOE,
            "intermediate_size": 256,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "head_dim": 64,
        },
    ),
    "qwen2_moe": Tiny(
        "moe",
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            **MOE,
            "intermediate_size": 256,
            "moe_intermediate_size": 128,
            "shared_expert_intermediate_size": 128,
            "num_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    "qwen3_moe": Tiny(
        "moe",
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            **MOE,
            "intermediate_size": 256,
            "moe_intermediate_size": 128,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "head_dim": 64,
        },
    ),
    "deepseek_v3": Tiny(
        "moe",
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            **MOE,
            "num_key_value_heads": 2,
            "intermediate_size": 256,
            "moe_intermediate_size": 128,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "q_lora_rank": 128,
            # DeepSeek-V3's latent cache, kv_lora_rank + qk_rope_head_dim = 576: the one MLA
            # head size vLLM's CPU kernels compile for.
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 32,
            "v_head_dim": 64,
            # As DeepSeek-V3's own config.json: its routers have a score-correction bias, which
            # vLLM builds only for this method (else it refuses the checkpoint's tensor).
            "topk_method": "noaux_tc",
        },
    ),
}


def _tokenizer(extra: dict[str, str] | None = None):
    """The demo tokenizer, with a vision processor's special tokens when it needs them."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = build_tokenizer(VOCAB)
    if not extra:
        return tokenizer
    tokenizer.add_special_tokens({"additional_special_tokens": list(extra.values())})
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend_tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        chat_template=tokenizer.chat_template,
        extra_special_tokens=extra,
        model_max_length=2048,
    )


def _text_model(spec: Tiny, tokenizer):
    import transformers

    config = getattr(transformers, spec.config)(
        vocab_size=len(tokenizer),
        num_hidden_layers=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **{"tie_word_embeddings": False, **spec.kwargs},
    )
    return getattr(transformers, spec.model)(config), tokenizer


def build_tiny(name: str, root: str | Path) -> Path:
    """Write the tiny `name` model to `root/name` unless it is there; return the folder."""
    import torch

    path = Path(root) / name
    marker = path / "tiny_spec.json"
    if marker.exists():
        return path
    torch.manual_seed(0)
    if name in ZOO:
        model, processor = _text_model(ZOO[name], _tokenizer())
    else:
        model, processor = VISION_BUILDERS[name]()
    with torch.no_grad():
        if model.config.get_text_config().tie_word_embeddings:
            # 10x either way: Gemma's norms scale by 1 + weight (0 at init), others by weight (1).
            model.model.norm.weight.add_(9)
        else:
            model.get_output_embeddings().weight.mul_(10)
    path.mkdir(parents=True, exist_ok=True)
    model.to(torch.float32).save_pretrained(path)
    processor.save_pretrained(path)
    marker.write_text(json.dumps({"name": name, "class": type(model).__name__}))
    return path


def _vision_common(tokenizer) -> dict[str, Any]:
    return dict(
        vocab_size=(len(tokenizer) + 63) // 64 * 64,  # special tokens' ids all fall below
        num_hidden_layers=2,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **TEXT,
    )


def _llava():
    import transformers as T

    tokenizer = _tokenizer(VISION_TOKENS["llava"])
    config = T.LlavaConfig(
        text_config=dict(model_type="llama", **_vision_common(tokenizer)),
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
            projection_dim=64,
        ),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    images = T.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = T.LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,
        chat_template=vision_chat_template("<image>"),
    )
    return T.LlavaForConditionalGeneration(config), processor


def _qwen2_5_vl():
    import transformers as T

    tokenizer = _tokenizer(VISION_TOKENS["qwen2_5_vl"])
    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in VISION_TOKENS["qwen2_5_vl"].items()}
    config = T.Qwen2_5_VLConfig(
        text_config=dict(
            **_vision_common(tokenizer),
            rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]},
        ),
        vision_config=dict(
            depth=2,
            hidden_size=64,
            intermediate_size=128,
            num_heads=2,
            out_hidden_size=128,
            fullatt_block_indexes=[1],
            window_size=56,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=ids["image_token"],
        video_token_id=ids["video_token"],
        vision_start_token_id=ids["vision_start_token"],
        vision_end_token_id=ids["vision_end_token"],
    )
    # Qwen2_5_VLProcessor needs a video processor, which needs torchvision (no CPU wheel that
    # loads beside this torch): the folder gets the image processor and the tokenizer instead.
    return T.Qwen2_5_VLForConditionalGeneration(config), _Saved(
        T.Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=56 * 56), tokenizer
    )


def _mllama():
    import transformers as T

    tokenizer = _tokenizer(VISION_TOKENS["mllama"])
    config = T.MllamaConfig(
        text_config=dict(**_vision_common(tokenizer), cross_attention_layers=[1]),
        vision_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_global_layers=1,
            attention_heads=2,
            image_size=32,
            patch_size=8,
            vision_output_dim=128,
            intermediate_layers_indices=[0],
            max_num_tiles=4,
        ),
        image_token_index=tokenizer.convert_tokens_to_ids("<|image|>"),
    )
    images = T.MllamaImageProcessor(size={"height": 32, "width": 32}, max_image_tiles=4)
    return T.MllamaForConditionalGeneration(config), T.MllamaProcessor(
        image_processor=images, tokenizer=tokenizer, chat_template=vision_chat_template("<|image|>")
    )


def _gemma3():
    import transformers as T

    tokenizer = _tokenizer(VISION_TOKENS["gemma3"])
    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in VISION_TOKENS["gemma3"].items()}
    config = T.Gemma3Config(
        text_config=dict(**_vision_common(tokenizer), head_dim=32, sliding_window=64),
        vision_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
            vision_use_head=False,
        ),
        mm_tokens_per_image=4,
        image_token_index=ids["image_token"],
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
    )
    images = T.Gemma3ImageProcessor(size={"height": 32, "width": 32})
    return T.Gemma3ForConditionalGeneration(config), T.Gemma3Processor(
        image_processor=images,
        tokenizer=tokenizer,
        image_seq_length=4,
        chat_template=vision_chat_template("<start_of_image>"),
    )


@dataclass(frozen=True)
class _Saved:
    """Several preprocessing objects saved into one folder, like a processor would be."""

    images: Any
    tokenizer: Any

    def save_pretrained(self, path: Path) -> None:
        self.images.save_pretrained(path)
        self.tokenizer.save_pretrained(path)


VISION_BUILDERS: dict[str, Callable[[], tuple[Any, Any]]] = {
    "llava": _llava,
    "qwen2_5_vl": _qwen2_5_vl,
    "mllama": _mllama,
    "gemma3": _gemma3,
}


def model_class(name: str) -> str:
    """The transformers class compress-model loads `name` with (model.model_class)."""
    return ZOO[name].model_class if name in ZOO else VISION_CLASSES[name]


VISION_CLASSES: dict[str, str] = {
    "llava": "LlavaForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "mllama": "MllamaForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
}
