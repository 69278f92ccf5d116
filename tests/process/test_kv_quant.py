"""Quantized KV cache (``--kv-bits``): works in batches and with the prefix cache, costs what
the admission estimate says, and relies on mlx-lm internals checked here by contract."""

from __future__ import annotations

import time

import httpx
import mlx.core as mx
import pytest
from engine_runner import drive, generate_all, request, running_engine, solo
from payloads import chat
from support import build_wide_model, free_port

from mlx_server.engine.cache.kv_quant import (
    BatchableQuantizedKVCache,
    BatchQuantizedKVCache,
    QuantizedKVModel,
)
from mlx_server.models.loader import kv_bytes_per_token


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    from mlx_lm import load

    path = build_wide_model(tmp_path_factory.mktemp("wide") / "tiny-wide", layers=3)
    model, tokenizer, config = load(str(path), return_config=True)  # type: ignore[misc]
    return model, tokenizer, config, path


def prompts(tokenizer, n: int = 4) -> list[list[int]]:
    return [
        list(tokenizer.encode(f"request {i}: the quick brown fox " * (3 * i + 1))) for i in range(n)
    ]


def test_contract_mlx_lm_batches_caches_through_their_merge_and_attends_quantized(wide):
    """What this module needs from mlx-lm: BatchGenerator builds a sequence's cache with
    ``model.make_cache``, merges the caches of a prefill batch with the first one's ``merge``
    classmethod, returns per-sequence caches with ``extract``, and attention takes the
    quantized path for a cache with ``bits``."""
    import inspect

    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models import base
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer, _, _ = wide
    qmodel = QuantizedKVModel(model, 8, 64)
    assert all(isinstance(c, BatchableQuantizedKVCache) for c in make_prompt_cache(qmodel)), (
        "mlx_lm.models.cache.make_prompt_cache no longer asks model.make_cache"
    )
    assert 'hasattr(cache, "bits")' in inspect.getsource(base.scaled_dot_product_attention), (
        "mlx-lm's attention no longer picks the quantized path by the cache's `bits`"
    )
    gen = BatchGenerator(qmodel, completion_batch_size=4, prefill_batch_size=4)
    uids = gen.insert(prompts(tokenizer, 3), max_tokens=[3, 3, 3])
    caches = {}
    deadline = time.monotonic() + 120
    while len(caches) < len(uids):
        assert time.monotonic() < deadline, "the batch did not finish in 120 s"
        for r in gen.next()[1]:
            if r.finish_reason is not None:
                caches[r.uid] = r.prompt_cache
    gen.close()
    for cache in caches.values():
        assert all(isinstance(c, BatchableQuantizedKVCache) for c in cache), (
            "BatchGenerator no longer merges and extracts caches through the cache classes"
        )


def test_a_batch_gives_the_same_tokens_as_each_prompt_alone(wide):
    model, tokenizer, _, _ = wide
    qmodel = QuantizedKVModel(model, 8, 64)
    ps = prompts(tokenizer)
    with running_engine(qmodel, tokenizer, prompt_cache_size=0) as engine:
        together = drive(engine, generate_all(engine, [request(p, 10) for p in ps]))
        alone = solo(engine, [request(p, 10) for p in ps])
    assert [r.text for r in together] == [r.text for r in alone]
    assert all(r.finished.usage.completion_tokens == 10 for r in together)


@pytest.mark.parametrize("bits", [8, 4])
def test_prefix_cache_hits_give_the_same_output(wide, bits):
    model, tokenizer, _, _ = wide
    qmodel = QuantizedKVModel(model, bits, 64)
    ps = prompts(tokenizer)
    with running_engine(qmodel, tokenizer) as engine:
        first = solo(engine, [request(p, 8) for p in ps])
        again = solo(engine, [request(p, 8) for p in ps])
    entry = engine.prefix_cache.fetch(ps[-1])[0]  # type: ignore[union-attr]
    assert all(r.cached < len(p) // 2 for r, p in zip(first, ps, strict=True))
    assert [r.cached for r in again] == [len(p) - 1 for p in ps]
    assert [r.text for r in again] == [r.text for r in first]
    assert entry is not None and all(c.bits == bits for c in entry)


def test_8_bit_kv_costs_what_the_estimate_says_and_about_half_of_16_bit(wide):
    model, tokenizer, config, _ = wide
    model.set_dtype(mx.float16)
    mx.eval(model.parameters())  # here: the engine thread cannot run this thread's ops
    try:
        p = prompts(tokenizer, 4)[-1]
        per_token = {}
        for bits in (None, 8, 4):
            m = model if bits is None else QuantizedKVModel(model, bits, 64)
            with running_engine(m, tokenizer) as engine:
                solo(engine, [request(p, 1)])
            (cache, rest) = engine.prefix_cache.fetch(p + [5])  # type: ignore[union-attr]
            n = len(p) + 1 - len(rest)
            per_token[bits] = sum(c.nbytes for c in _cut(cache, n)) / n
            assert per_token[bits] == kv_bytes_per_token(config, 2, bits, 64)
        assert per_token[8] <= 0.55 * per_token[None]
        assert per_token[4] <= 0.30 * per_token[None]
    finally:
        model.set_dtype(mx.float32)
        mx.eval(model.parameters())


def _cut(cache, n):
    """The cache's arrays cut to its ``n`` tokens (buffers grow in steps of 256)."""
    from mlx_lm.models.cache import KVCache

    out = []
    for c in cache:
        if isinstance(c, KVCache):
            k = KVCache()
            k.keys, k.values = c.keys[..., :n, :], c.values[..., :n, :]
        else:
            k = BatchableQuantizedKVCache(c.group_size, c.bits)
            k.keys = tuple(x[..., :n, :] for x in c.keys)
            k.values = tuple(x[..., :n, :] for x in c.values)
        out.append(k)
    return out


def test_batched_cache_merge_extract_round_trip():
    """Per-sequence states of different lengths merged into a batch come back unchanged."""
    seqs = []
    for n in (5, 17, 0):
        c = BatchableQuantizedKVCache(group_size=64, bits=8)
        if n:
            x = mx.random.normal((1, 2, n, 64))
            c.update_and_fetch(x, -x)
        seqs.append(c)
    batch = BatchQuantizedKVCache.merge(seqs)
    assert batch.left_padding.tolist() == [12, 0, 17] and batch.size() == 17
    for i, c in enumerate(seqs[:2]):
        back = batch.extract(i)
        assert back.offset == c.offset
        for a, b in zip(back.keys, c.keys, strict=True):
            assert mx.array_equal(a, b[..., : c.offset, :])
    batch.filter([1])
    assert batch.left_padding.tolist() == [0] and batch.extract(0).offset == 17


def test_the_server_runs_with_8_bit_kv_and_serves_it_from_disk_after_a_restart(
    server_factory, wide, tmp_path
):
    _, _, _, path = wide
    port = free_port()
    cmd = ["-m", str(path), "--port", str(port), "--ctx-size", "4096", "--kv-bits", "8"]
    cmd += ["--prompt-cache-dir", str(tmp_path)]
    body = chat("the quick brown fox " * 80, max_tokens=6, temperature=0)
    first = server_factory(cmd)
    assert any("KV cache: 8-bit" in line for line in first.lines)
    cold = httpx.post(first.base_url + "/v1/chat/completions", json=body, timeout=120).json()
    first.stop()
    second = server_factory(cmd)
    warm = httpx.post(second.base_url + "/v1/chat/completions", json=body, timeout=120).json()
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
    assert (
        warm["usage"]["prompt_tokens_details"]["cached_tokens"]
        == cold["usage"]["prompt_tokens"] - 1
    )
    h = httpx.get(second.base_url + "/health").json()
    assert h["prompt_cache_disk_hits"] == 1
