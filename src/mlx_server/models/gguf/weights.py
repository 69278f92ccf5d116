"""GGUF tensors -> mlx-lm weights: names, q/k row order, quantization and dtype."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .reader import GGUFImportError

# Every GGML quantization MLX keeps packed (Q4_0, Q4_1, Q8_0) uses blocks of 32 values.
GGML_GROUP_SIZE = 32

FLOAT_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors that only feed the config: Llama 3's RoPE factors become `rope_scaling`.
_CONFIG_ONLY = {"rope_freqs"}
_TENSOR_NAME = re.compile(r"^(?:blk\.(\d+)\.)?(\w+)\.(weight|bias|scales|biases)$")


@dataclass(frozen=True)
class WeightPlan:
    """How to turn the file's tensors into the model's weights."""

    config: dict[str, Any]
    dtype: str | None  # dequantize everything to this float dtype; None keeps quantization
    float_dtype: str  # dtype of scales, biases and unquantized tensors when kept quantized
    undo_qk_permutation: bool  # llama.cpp reorders q/k rows of "llama" files


def module_path(gguf_module: str, block: str | None) -> str:
    """The mlx-lm module path for a GGUF module name such as `attn_q` in block 3."""
    table = _BLOCK_NAMES if block is not None else _GLOBAL_NAMES
    if gguf_module not in table:
        raise GGUFImportError(
            f"unexpected GGUF tensor {gguf_module!r}; this architecture has no such part"
        )
    return f"model.layers.{block}.{table[gguf_module]}" if block is not None else table[gguf_module]


def group_modules(tensors: dict[str, mx.array]) -> dict[str, dict[str, mx.array]]:
    """Tensors grouped by mlx-lm module path: {path: {"weight": .., "scales": .., ...}}."""
    modules: dict[str, dict[str, mx.array]] = {}
    for name, array in tensors.items():
        match = _TENSOR_NAME.match(name)
        if match is None:
            raise GGUFImportError(f"unexpected GGUF tensor name {name!r}")
        block, part, kind = match.groups()
        if block is None and part in _CONFIG_ONLY:
            continue
        modules.setdefault(module_path(part, block), {})[kind] = array
    return modules


def check_complete(modules: dict[str, dict[str, mx.array]], config: dict[str, Any]) -> None:
    """Fail early, naming the part, when a block or a global tensor is missing."""
    required = ["model.embed_tokens", "model.norm"]
    if not config["tie_word_embeddings"]:
        required.append("lm_head")
    qk_norms = ("self_attn.q_norm", "self_attn.k_norm")
    per_block = [name for name in _BLOCK_NAMES.values() if name not in qk_norms]
    if config["model_type"] == "qwen3":
        per_block += qk_norms
    for layer in range(config["num_hidden_layers"]):
        required += [f"model.layers.{layer}.{name}" for name in per_block]
    missing = [path for path in required if path not in modules]
    if missing:
        raise GGUFImportError(f"GGUF file lacks {len(missing)} tensors, e.g. {missing[0]}")
    layers = config["num_hidden_layers"]
    extra = [p for p in modules if p.startswith("model.layers.") and int(p.split(".")[2]) >= layers]
    if extra:
        raise GGUFImportError(f"GGUF file has tensors beyond its {layers} blocks, e.g. {extra[0]}")


def quantized_bits(parts: dict[str, mx.array]) -> int:
    """Bits per value of a packed tensor: its uint32 words against its number of groups."""
    words, groups = parts["weight"].shape[-1], parts["scales"].shape[-1]
    return words * 32 // (groups * GGML_GROUP_SIZE)


def convert_modules(
    modules: dict[str, dict[str, mx.array]], plan: WeightPlan
) -> Iterator[tuple[str, dict[str, mx.array]]]:
    """Yield (module path, converted parameters), lazily: evaluate them one at a time."""
    for path, parts in modules.items():
        parts = _unpermute(path, parts, plan)
        if "scales" in parts and plan.dtype is not None:
            parts = _dequantize(parts, FLOAT_DTYPES[plan.dtype])
        target = FLOAT_DTYPES[plan.dtype or plan.float_dtype]
        yield path, {name: _cast(array, target) for name, array in parts.items()}


def quantization_config(modules: dict[str, dict[str, mx.array]]) -> dict[str, Any] | None:
    """mlx-lm's `quantization` entry: the commonest bits as default, others per module.

    Modules left unquantized get an explicit `False` so that no mlx-lm version quantizes them
    with the default settings.
    """
    bits = {path: quantized_bits(p) for path, p in modules.items() if "scales" in p}
    if not bits:
        return None
    default_bits = Counter(bits.values()).most_common(1)[0][0]
    config: dict[str, Any] = {"group_size": GGML_GROUP_SIZE, "bits": default_bits, "mode": "affine"}
    for path, parts in modules.items():
        if path in bits and bits[path] != default_bits:
            config[path] = {"group_size": GGML_GROUP_SIZE, "bits": bits[path], "mode": "affine"}
        elif path not in bits and parts["weight"].ndim == 2:
            config[path] = False
    return config


def _unpermute(path: str, parts: dict[str, mx.array], plan: WeightPlan) -> dict[str, mx.array]:
    """Put q/k rows back in Hugging Face order for llama files.

    llama.cpp's converter interleaves the two rotary halves of each head's rows. A packed row
    holds one whole output row, so weight, scales and biases all move together.
    """
    if not plan.undo_qk_permutation or plan.config["model_type"] != "llama":
        return parts
    if path.endswith("self_attn.q_proj"):
        heads = plan.config["num_attention_heads"]
    elif path.endswith("self_attn.k_proj"):
        heads = plan.config["num_key_value_heads"]
    else:
        return parts
    return {name: _unpermute_rows(array, heads) for name, array in parts.items()}


def _unpermute_rows(array: mx.array, heads: int) -> mx.array:
    """Inverse of llama.cpp's `permute`: rows (heads, half, 2) -> (heads, 2, half)."""
    shape = array.shape
    half = shape[0] // heads // 2
    grouped = array.reshape(heads, half, 2, *shape[1:])
    return grouped.swapaxes(1, 2).reshape(shape)


def _dequantize(parts: dict[str, mx.array], dtype: mx.Dtype) -> dict[str, mx.array]:
    """Expand a packed tensor to floats; other parameters (a linear bias) pass through."""
    # Expand in float32 so that a float32 import keeps every bit the file has.
    weight = mx.dequantize(
        parts["weight"],
        parts["scales"].astype(mx.float32),
        parts["biases"].astype(mx.float32),
        group_size=GGML_GROUP_SIZE,
        bits=quantized_bits(parts),
    ).astype(dtype)
    rest = {k: v for k, v in parts.items() if k not in ("weight", "scales", "biases")}
    return {"weight": weight, **rest}


def _cast(array: mx.array, dtype: mx.Dtype) -> mx.array:
    """Floats to the target dtype; packed integer weights unchanged."""
    if mx.issubdtype(array.dtype, mx.floating) and array.dtype != dtype:
        return array.astype(dtype)
    return array
