"""The shapes make_random_model.py builds: real models' published configs, with SmolLM2's tokenizer
(vocabulary 49,152, <|im_end|> = 2) in place of each model's own, and scaled-down twins that take
the same code paths on a CPU. Only the vocabulary differs from the real config: the embedding and
the output layer are smaller than the real ones (Qwen3.5: 248,320 tokens; gpt-oss: 201,088)."""

from __future__ import annotations

import copy

# The tokenizer the kit carries (SmolLM2's): its size and special tokens replace the model's own.
VOCAB = {"vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2}

LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
}

# Qwen3.5-9B's text model (Qwen/Qwen3.5-9B config.json, text_config, as republished in its
# derivatives' configs): 32 layers, every 4th full attention (gated, head_dim 256, 16 heads over 4
# KV heads, rope on a quarter of each head, theta 1e7), the other 24 gated-delta linear attention
# (16 key heads, 32 value heads, 128 wide, conv kernel 4). The published config nests this under
# text_config beside a vision tower; mlx-lm reads the flat form as the text model alone. The
# multimodal rope sections are left out: they only place image tokens.
QWEN35 = {
    "model_type": "qwen3_5",
    "architectures": ["Qwen3_5ForCausalLM"],
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "attn_output_gate": True,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
    },
}

# openai/gpt-oss-20b config.json: 24 layers alternating sliding (window 128) and full attention,
# sinks on both, 64 heads of 64 over 8 KV heads with biases, YaRN rope (factor 32 over 4,096),
# 32 experts of 2,880, top 4, SwiGLU clamped at 7.
GPTOSS = {
    "model_type": "gpt_oss",
    "architectures": ["GptOssForCausalLM"],
    "rms_norm_eps": 1e-5,
    "attention_bias": True,
    "max_position_embeddings": 131072,
    "initial_context_length": 4096,
    "rope_theta": 150000,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 4096,
        "truncate": False,
    },
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
}


def qwen35(layers: int, **shape) -> dict:
    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    return {
        **QWEN35,
        "num_hidden_layers": layers,
        "full_attention_interval": 4,
        "layer_types": kinds,
        **shape,
    }


def gptoss(layers: int, **shape) -> dict:
    kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return {**GPTOSS, "num_hidden_layers": layers, "layer_types": kinds, **shape}


def experts(n: int, top: int) -> dict:
    # gpt-oss's config names these twice; mlx-lm reads the first pair.
    return {
        "num_local_experts": n,
        "num_experts_per_tok": top,
        "experts_per_token": top,
    }


PRESETS: dict[str, dict] = {
    "1b": {
        **LLAMA,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 16,
        "tie_word_embeddings": True,
    },
    "8b": {
        **LLAMA,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
        "tie_word_embeddings": False,
    },
    "tiny": {
        **LLAMA,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "tie_word_embeddings": True,
    },
    "qwen35-9b": qwen35(
        32,
        hidden_size=4096,
        intermediate_size=12288,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=False,
    ),
    "tiny-qwen35": qwen35(
        4,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=False,
    ),
    "gptoss-20b": gptoss(
        24,
        hidden_size=2880,
        intermediate_size=2880,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        sliding_window=128,
        **experts(32, 4),
    ),
    "tiny-gptoss": gptoss(
        4,
        hidden_size=128,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=16,
        **experts(4, 2),
    ),
}


def config_for(preset: str) -> dict:
    """The config.json (before quantization) of a preset."""
    if preset not in PRESETS:
        raise SystemExit(f"unknown preset {preset!r}; one of {', '.join(PRESETS)}")
    # A copy: mlx-lm's model args rewrite nested dicts (rope parameters) in place.
    return copy.deepcopy({**PRESETS[preset], **VOCAB})
