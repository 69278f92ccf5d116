#!/usr/bin/env python3
"""Random-weight models of real shapes, built with mlx-lm's own classes, for speed measurements only.

Usage: make_random_model.py OUT_DIR PRESET BITS TOKENIZER_DIR [--count]
  PRESET (vocabulary: the tokenizer's, 49,152 for SmolLM2, in place of each model's own):
    1b          Llama-3.2-1B shape                          8b   Llama-3.1-8B shape
    qwen35-9b   Qwen3.5-9B's text model: hybrid, 24 gated-delta (ArraysCache) + 8 full-attention layers
    gptoss-20b  gpt-oss-20b: 24 layers alternating sliding (window 128, RotatingKVCache) and full
                attention, both with sinks; YaRN rope; 32 experts, top 4
    tiny, tiny-qwen35, tiny-gptoss: the same code paths scaled down, for tests on a CPU.
  BITS: 0 = bfloat16, 4 = 4-bit affine (group 64; the model's own rule where it has one: gpt-oss's
  router at 8 bits).
  --count: print the parameter count and the cache kinds from the shapes; build nothing.
  --decisive: greedy decoding with wide margins (``decisive``), for speculation's ceiling: the
  plain answer is then the same whatever kernels run (a random 8B's top two logits differed by
  0.005 at almost every token, so a pass over 9 tokens chose otherwise than a decode step).
Speed does not depend on weight values; answers are noise, so benchmarks must not stop on EOS early
(use fixed max_tokens and check completion_tokens).
"""

import importlib
import json
import shutil
import sys
from collections import Counter
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map_with_path, tree_reduce
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import quantize_model, save_config, save_model
from presets import config_for


def build(config: dict):
    """The model of ``config`` with weights drawn small (finite activations in bf16) and lazily:
    nothing is computed until the weights are saved, one shard at a time."""
    family = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = family.Model(family.ModelArgs.from_dict(config))
    castable = getattr(model, "cast_predicate", None) or (lambda path: True)

    def draw(path: str, p: mx.array) -> mx.array:
        # Checkpoints keep what cast_predicate refuses (Qwen3.5's A_log) in float32; so does this.
        dtype = mx.bfloat16 if castable(path) else mx.float32
        return mx.random.normal(p.shape, dtype=dtype, scale=0.02)

    model.update(tree_map_with_path(draw, model.parameters()))
    return model


def decisive(model) -> None:
    """Make greedy decoding decisive, shapes and kernels unchanged: every norm's weight 1, the
    layers' outputs into the residual stream (``o_proj``, ``down_proj``) 100 times smaller, so
    the last hidden state is about the current token's embedding; an untied output layer is
    the embedding table in a fixed random order, so the next token is a fixed permutation of
    the current one (a tied one repeats it). The winning logit is then about 0.02 x hidden
    size above the others' spread of 0.02 x its square root (82 against 1.3 for 4,096)."""

    def fix(path: str, p: mx.array) -> mx.array:
        leaf = path.split(".")
        if any("norm" in part for part in leaf) and leaf[-1] == "weight":
            return mx.ones_like(p)
        if leaf[-2:-1] and leaf[-2] in ("o_proj", "down_proj") and leaf[-1] == "weight":
            return p * 0.01
        return p

    model.update(tree_map_with_path(fix, model.parameters()))
    head = getattr(model, "lm_head", None)
    if head is not None:
        table = model.model.embed_tokens.weight
        order = mx.random.permutation(table.shape[0])
        head.weight = table[order]


def shape_facts(model) -> dict:
    """Parameter count and cache kinds per layer, read from shapes alone (nothing is computed)."""
    kinds = Counter(type(c).__name__ for c in make_prompt_cache(model))
    return {
        "parameters": tree_reduce(lambda n, p: n + p.size, model.parameters(), 0),
        "caches": dict(sorted(kinds.items())),
    }


def copy_tokenizer(tok: Path, out: Path) -> None:
    for f in tok.iterdir():
        if f.name.startswith("tokenizer") or f.name in (
            "special_tokens_map.json",
            "chat_template.jinja",
        ):
            shutil.copy(f, out / f.name)


def main(argv: list[str]) -> None:
    out, preset, bits, tok = Path(argv[0]), argv[1], int(argv[2]), Path(argv[3])
    config = config_for(preset)
    mx.random.seed(0)
    model = build(config)
    if "--decisive" in argv[4:]:
        decisive(model)
    if "--count" in argv[4:]:
        print(json.dumps({"preset": preset, **shape_facts(model)}))
        return
    if bits:
        model, config = quantize_model(model, config, group_size=64, bits=bits)
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model, donate_model=True)
    save_config(config, out / "config.json")
    copy_tokenizer(tok, out)
    print(json.dumps({"model": str(out), "preset": preset, "bits": bits}))


if __name__ == "__main__":
    main(sys.argv[1:])
