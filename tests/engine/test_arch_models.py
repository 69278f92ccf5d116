"""The architecture builders (tests/helpers/arch_models.py): every family builds, loads through
mlx-lm, has each of its layer kinds, and generates alone and in a batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from arch_models import FAMILIES, build

pytestmark = pytest.mark.tiny

FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_loads_and_generates(arch_model_dirs: dict[str, Path], name: str) -> None:
    import mlx.core as mx
    from mlx_lm import batch_generate, load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = load(str(arch_model_dirs[name]))
    kinds = {type(c).__name__ for c in make_prompt_cache(model)}
    assert kinds == FAMILIES[name].caches
    # Every token the tokenizer knows (bos and eos included) has an embedding.
    config = json.loads((arch_model_dirs[name] / "config.json").read_text())
    assert len(tokenizer._tokenizer) == config.get("text_config", config)["vocab_size"]

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    steps = generate_step(mx.array(prompt), model, max_tokens=6)
    tokens = [int(t) for t, _ in steps]
    assert len(tokens) == 6
    assert all(0 <= t < tokenizer.vocab_size for t in tokens)

    batch = batch_generate(model, tokenizer, [prompt, prompt[:4]], max_tokens=3)
    assert len(batch.texts) == 2


def test_builds_are_deterministic(tmp_path: Path) -> None:
    for name in FAMILIES:
        a, b = build(name, tmp_path / "a" / name), build(name, tmp_path / "b" / name)
        for f in FILES:
            assert (a / f).read_bytes() == (b / f).read_bytes(), (name, f)
