"""The mlx-lm `config.json` for a GGUF model, from its `general.architecture` metadata."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np

from .reader import GGUFImportError

# GGUF architecture -> mlx-lm model type. Mistral and SmolLM files say "llama".
SUPPORTED_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

_HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_DEFAULT_ROPE_THETA = {"llama": 10000.0, "qwen2": 1000000.0, "qwen3": 1000000.0}


def architecture(metadata: dict[str, Any]) -> str:
    """The file's architecture, checked against the supported set."""
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFImportError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    return str(arch)


def model_config(metadata: dict[str, Any], tensors: dict[str, mx.array]) -> dict[str, Any]:
    """The `config.json` fields mlx-lm needs to build the model (quantization comes later)."""
    arch = architecture(metadata)

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFImportError(f"GGUF metadata lacks {arch}.{key}")
        return value

    n_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // n_heads))
    rope_dims = int(get("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise GGUFImportError(
            f"partial rotary embeddings ({rope_dims} of {head_dim}) are not supported"
        )
    if arch == "qwen2" and head_dim * n_heads != hidden:
        raise GGUFImportError("qwen2 with head_dim * heads != hidden size is not supported")
    config: dict[str, Any] = {
        "architectures": [_HF_ARCHITECTURES[arch]],
        "model_type": SUPPORTED_ARCHITECTURES[arch],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", _DEFAULT_ROPE_THETA[arch])),
        "max_position_embeddings": int(get("context_length", 4096)),
        "vocab_size": int(tensors["token_embd.weight"].shape[0]),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    rope_scaling = _rope_scaling(metadata, arch, tensors, config)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _rope_scaling(
    metadata: dict[str, Any], arch: str, tensors: dict[str, mx.array], config: dict[str, Any]
) -> dict[str, Any] | None:
    """RoPE scaling from `{arch}.rope.scaling.*`, or Llama 3's from its `rope_freqs` tensor."""
    if "rope_freqs.weight" in tensors:
        return _llama3_rope_scaling(metadata, arch, tensors["rope_freqs.weight"], config)
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if kind == "none" or not factor or factor == 1.0:
        return None
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if kind == "linear":
        return {"type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling: dict[str, Any] = {"type": "yarn", "factor": float(factor)}
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise GGUFImportError(f"RoPE scaling type {kind!r} is not supported (linear, yarn, llama3)")


def _llama3_rope_scaling(
    metadata: dict[str, Any], arch: str, rope_freqs: mx.array, config: dict[str, Any]
) -> dict[str, Any]:
    """Recover Llama 3's RoPE scaling parameters from the per-frequency factors llama.cpp stores.

    llama.cpp writes the factors instead of the parameters; every Llama 3.x release uses
    low/high frequency factors 1 and 4, so those are tried and checked against the tensor.
    """
    factors = np.array(rope_freqs.astype(mx.float32))
    original = int(metadata.get(f"{arch}.rope.scaling.original_context_length", 8192))
    scaling = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original,
    }
    expected = _llama3_factors(config["head_dim"], config["rope_theta"], scaling)
    if not np.allclose(expected, factors, rtol=1e-3):
        raise GGUFImportError("rope_freqs does not match Llama 3 RoPE scaling; not supported")
    return scaling


def _llama3_factors(dims: int, base: float, scaling: dict[str, Any]) -> np.ndarray:
    """The factor by which Llama 3 scaling stretches each rotary wavelength."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelens = 2 * math.pi * base ** (np.arange(0, dims, 2) / dims)
    smooth = (original / wavelens - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    return np.where(
        wavelens < original / high, 1.0, np.where(wavelens > original / low, factor, medium)
    )
