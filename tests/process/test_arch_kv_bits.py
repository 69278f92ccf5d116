"""``--kv-bits`` on every layer kind: the layers that can take a quantized KV cache get one,
the rest stay plain (and the start-up log says which and why); a model none of whose
layers can is refused at start. Never a server that starts and then fails its requests.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from arch_models import FAMILIES
from mlx_lm import load
from spec_arch import build_arch_model
from support import free_port, launch

from mlx_server.engine.cache import kv_quant_layers
from mlx_server.engine.cache.kv_quant import BatchableQuantizedKVCache, QuantizedKVModel
from mlx_server.engine.cache.kv_quant_layers import NoQuantizableLayer, plan_layers

pytestmark = pytest.mark.tiny


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kv-bits")
    names = ["gemma3_text", "gpt_oss", "qwen3_5", "gemma4_text", "llama_hd32"]
    return {f: build_arch_model(root / f, f) for f in names}


# ---- which layers, in process ------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "quantized", "plain"),
    [
        ("gemma3_text", [2], {0: "RotatingKVCache", 1: "RotatingKVCache"}),
        ("qwen3_5", [1, 3], {0: "ArraysCache", 2: "ArraysCache"}),
        ("gemma4_text", [1], {0: "RotatingKVCache", 2: "RotatingKVCache", 3: "shared"}),
    ],
)
def test_the_layers_that_can_take_it_are_quantized(
    models: dict[str, Path], family: str, quantized: list[int], plain: dict[int, str]
) -> None:
    model = load(str(models[family]))[0]
    plan = plan_layers(model, 8, 64)
    assert plan.quantized == quantized
    assert sorted(plan.plain) == sorted(plain)
    for i, why in plain.items():
        assert why in plan.plain[i]
    cache = QuantizedKVModel(model, 8, 64, plan.quantized).make_cache()
    assert [i for i, c in enumerate(cache) if type(c) is BatchableQuantizedKVCache] == quantized


@pytest.mark.parametrize(
    ("family", "why"),
    [("gpt_oss", "attention sinks"), ("llama_hd32", "head dimension 32")],
)
def test_a_model_no_layer_of_which_can_take_it_is_refused(
    models: dict[str, Path], family: str, why: str
) -> None:
    model = load(str(models[family]))[0]
    with pytest.raises(NoQuantizableLayer, match=why):
        plan_layers(model, 8, 64)


def test_a_layer_the_rules_miss_is_found_by_the_trial(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load(str(models["gpt_oss"]))[0]
    monkeypatch.setattr(kv_quant_layers, "_with_sinks", lambda *a: {})  # rule not applied
    with pytest.raises(NoQuantizableLayer, match="Quantized SDPA does not support"):
        plan_layers(model, 8, 64)


# ---- through the real server ---------------------------------------------------------------


def _chat(base: str, text: str, *, stream: bool = False, **kw: Any) -> httpx.Response:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        **kw,
    }
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)


def _content(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_5", "gemma4_text"])
def test_the_server_serves_with_kv_bits_and_speculation(
    models: dict[str, Path], family: str
) -> None:
    port = free_port()
    sp = launch(
        ["-m", str(models[family]), "--port", str(port), "--kv-bits", "8", "--prompt-lookup"]
        + ["--max-batch-size", "4", "--prompt-cache-dir", ""]
    )
    try:
        assert sp.wait_ready(), sp.lines
        assert any("layers quantized" in line for line in sp.lines), sp.lines
        base = sp.base_url
        long = "The quick brown fox jumps over the lazy dog. " * 6
        first = _content(_chat(base, long))
        assert _content(_chat(base, long)) == first  # the same, from the prefix cache
        edited = _content(_chat(base, long, prediction={"type": "content", "content": "x"}))
        assert edited == first
        with ThreadPoolExecutor(4) as pool:  # a batch of quantized and plain layers
            rs = list(pool.map(lambda i: _chat(base, f"{long} {i}", stream=i % 2 == 1), range(4)))
        assert [r.status_code for r in rs] == [200] * 4
        assert all("[DONE]" in r.text for r in rs[1::2])
        assert not any("Traceback" in line for line in sp.lines), sp.lines
    finally:
        sp.stop()


def test_the_server_refuses_at_start_when_no_layer_can_take_it(models: dict[str, Path]) -> None:
    sp = launch(["-m", str(models["gpt_oss"]), "--port", str(free_port()), "--kv-bits", "8"])
    try:
        assert sp.wait_exit(120) == 1
        out = "\n".join(sp.lines) + sp.stderr_text()
        assert "no layer of this model can hold a quantized KV cache" in out
        assert "attention sinks" in out
    finally:
        sp.stop()


# ---- every family of the matrix, with heads wide enough for a group of 32 -----------------

# What no layer of these can take: sliding windows beside KV-sharing or sink layers; MLA
# (mlx-lm's attention over compressed latents fails on a quantized cache).
REFUSED = {
    "gemma4_text": "shared",
    "gpt_oss": "attention sinks",
    "deepseek_v3": "quantized attention fails",
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_serves_with_kv_bits_or_is_refused(tmp_path: Path, family: str) -> None:
    """The family's tiny model with 32-wide heads and ``--kv-bits 8 --kv-group-size 32``:
    the layers that can take it are quantized, and greedy output alone is mlx-lm's own on the
    same cache; a batch of two runs to its end. Or the plan refuses, saying why."""
    import mlx.core as mx
    from arch_models import build
    from engine_runner import drive, generate_all, request, running_engine, solo
    from mlx_lm.generate import generate_step

    from mlx_server.models.base import settle_arrays

    model, tokenizer = load(str(build(family, tmp_path / family, head_dim=32)))[:2]
    if family in REFUSED:
        with pytest.raises(NoQuantizableLayer, match=REFUSED[family]):
            plan_layers(model, 8, 32)
        return
    plan = plan_layers(model, 8, 32)
    assert plan.quantized
    quantized = QuantizedKVModel(model, 8, 32, plan.quantized)
    settle_arrays(model)
    prompt = [(7 * i) % 150 + 20 for i in range(40)]  # past the sliding windows (16)
    want = [int(t) for t, _ in generate_step(mx.array(prompt), quantized, max_tokens=4)]
    with running_engine(quantized, tokenizer, prompt_cache_size=0) as engine:
        # Raw text continued: the first token keeps its leading space, as decode gives it.
        (alone,) = solo(engine, [request(prompt, 4, ignore_eos=True, continues_text=True)])
        pair = [request(prompt, 4, ignore_eos=True), request(prompt[::-1], 4, ignore_eos=True)]
        batched = drive(engine, generate_all(engine, pair))
    assert alone.text == tokenizer.decode(want)
    assert [r.finished.reason for r in batched] == ["length", "length"]
