#!/usr/bin/env python3
"""Random-weight Llama-architecture model of a real size, for speed measurements only.

Usage: make_random_model.py OUT_DIR PRESET BITS TOKENIZER_DIR
  PRESET: 1b (Llama-3.2-1B shape) or 8b (Llama-3.1-8B shape); vocab is the tokenizer's (49152 for SmolLM2).
  BITS: 0 = bfloat16, 4 = 4-bit affine (group 64).
Speed does not depend on weight values; answers are noise, so benchmarks must not stop on EOS early
(use fixed max_tokens and check completion_tokens).
"""

import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx_lm.utils import quantize_model, save_config, save_model

PRESETS = {
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=16,
        tie_word_embeddings=True,
    ),
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=32,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        tie_word_embeddings=True,
    ),
}

out, preset, bits, tok = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
config = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "bos_token_id": 1,
    "eos_token_id": 2,
    **PRESETS[preset],
}
mx.random.seed(0)
model = llama.Model(llama.ModelArgs.from_dict(config))
# Small weights keep activations finite in bf16.
model.update(
    nn.utils.tree_map(
        lambda p: (mx.random.normal(p.shape) * 0.02).astype(mx.bfloat16), model.parameters()
    )
)
mx.eval(model.parameters())
if bits:
    model, config = quantize_model(model, config, group_size=64, bits=bits)
out.mkdir(parents=True, exist_ok=True)
save_model(out, model)
save_config(config, out / "config.json")
for f in tok.iterdir():
    if f.name.startswith("tokenizer") or f.name in (
        "special_tokens_map.json",
        "chat_template.jinja",
    ):
        shutil.copy(f, out / f.name)
print(json.dumps({"model": str(out), "preset": preset, "bits": bits}))
