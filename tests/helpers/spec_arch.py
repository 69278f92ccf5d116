"""Tiny random-weight models of the layer kinds speculation and ``--kv-bits`` must handle,
built with mlx-lm's own classes and written to disk with the tests' BPE tokenizer.

- ``llama``: plain KV layers;
- ``gemma3_text``: sliding-window layers (``RotatingKVCache``, a window of 16) and full ones;
- ``gpt_oss``: sliding-window layers and full ones, every layer with attention sinks;
- ``qwen3_5``: gated-delta layers (``ArraysCache``) and full attention (hybrid);
- ``gemma4_text``: E2B-like, its last two layers reuse layers 2 and 3's keys and values;
- ``llama_hd32``: a head dimension (32) below the default quantization group size (64).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tiny_model import build_tokenizer

WINDOW = 16  # sliding-window size: the tests' prompts are longer

_COMMON = {"hidden_size": 64, "intermediate_size": 128, "rms_norm_eps": 1e-5}

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    "llama_hd32": {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
    "gemma3_text": {
        "model_type": "gemma3_text",
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "query_pre_attn_scalar": 64,
        "sliding_window": WINDOW,
        "sliding_window_pattern": 3,
    },
    "gpt_oss": {
        "model_type": "gpt_oss",
        "num_hidden_layers": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "head_dim": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "qwen3_5": {
        "model_type": "qwen3_5",
        "text_config": {
            **_COMMON,
            "model_type": "qwen3_5_text",
            "num_hidden_layers": 4,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "linear_num_value_heads": 2,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "linear_conv_kernel_dim": 4,
            "full_attention_interval": 2,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        },
    },
    "gemma4_text": {
        "model_type": "gemma4_text",
        "num_hidden_layers": 6,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "global_head_dim": 64,
        "num_kv_shared_layers": 2,  # layers 4, 5 reuse layers 2, 3's keys and values
        "hidden_size_per_layer_input": 16,
        "sliding_window": WINDOW,
        "sliding_window_pattern": 2,
        "layer_types": ["sliding_attention", "full_attention"] * 3,
    },
}


def _config(family: str, vocab_size: int) -> dict[str, Any]:
    cfg = json.loads(json.dumps(CONFIGS[family]))
    text = cfg.get("text_config", cfg)
    text.update({k: v for k, v in _COMMON.items() if k not in text})
    text["vocab_size"] = vocab_size
    if family == "gemma4_text":
        text["vocab_size_per_layer_input"] = vocab_size
    text.setdefault("max_position_embeddings", 4096)
    return cfg


def build_arch_model(path: Path, family: str, seed: int = 0) -> Path:
    """Write a tiny ``family`` model (config, weights, tokenizer) into ``path``."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path)
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    cfg = _config(family, max(len(vocab) + 8, 64))
    cfg["eos_token_id"] = vocab["<|im_end|>"]
    module = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(cfg))
    mx.eval(model.parameters())
    weights = dict(tree_flatten(model.parameters()))
    for name in weights:  # a sharper untied head: greedy output that does not just repeat
        if name.endswith("lm_head.weight"):
            weights[name] = weights[name] * 4.0
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def build_varied(family: str, path: Path) -> Path:
    """``arch_models``' model of ``family`` with an untied, sharper output head (or, for a
    family that always ties it, sharper embeddings): tied random weights mostly repeat one
    token under greedy decoding, which would make output comparisons vacuous."""
    import arch_models
    import mlx.core as mx
    from mlx.utils import tree_flatten

    arch_models.build(family, path)
    cfg = json.loads((path / "config.json").read_text())
    for level in (cfg, cfg.get("text_config")):
        if isinstance(level, dict):
            level["tie_word_embeddings"] = False
    mx.random.seed(1)
    weights = dict(tree_flatten(arch_models._model_class(cfg).parameters()))
    heads = [k for k in weights if k.endswith("lm_head.weight")]
    for k in heads or [k for k in weights if k.endswith("embed_tokens.weight")]:
        weights[k] = weights[k] * 4.0
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(cfg))
    return path
