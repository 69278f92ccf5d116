"""Short queries' attention on CUDA (models/cuda_attention.py): the plain computation gives
MLX's fused attention's results for every mask kind, grouped heads and sinks; only short
half-precision queries take it; ``install`` leaves MLX's function alone off CUDA."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_server.models import cuda_attention
from mlx_server.models.cuda_attention import plain_attention, short_query_attention

FUSED = mx.fast.scaled_dot_product_attention


def _qkv(batch=2, heads=8, kv_heads=2, length=9, keys=37, dim=64, dtype=mx.float32, seed=0):
    ks = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((batch, heads, length, dim), key=ks[0]).astype(dtype)
    k = mx.random.normal((batch, kv_heads, keys, dim), key=ks[1]).astype(dtype)
    v = mx.random.normal((batch, kv_heads, keys, dim), key=ks[2]).astype(dtype)
    return q, k, v


def _close(a: mx.array, b: mx.array, tol: float) -> None:
    a32, b32 = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_allclose(a32, b32, atol=tol, rtol=tol)


def _left_padded_mask(batch: int, length: int, keys: int) -> mx.array:
    """A batch's causal mask with left padding (row 1 starts 5 keys in), as mlx-lm makes it."""
    rows = mx.arange(keys - length, keys)[:, None] >= mx.arange(keys)[None, :]
    pad = mx.array([0, 5])[:batch, None, None, None]
    return mx.logical_and(rows[None, None], mx.arange(keys)[None, None, None, :] >= pad)


@pytest.mark.parametrize("kv_heads", [8, 2, 1])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "additive"])
def test_the_plain_attention_is_mlx_s(kv_heads, mask_kind):
    q, k, v = _qkv(kv_heads=kv_heads)
    scale = q.shape[-1] ** -0.5
    mask = {
        "none": None,
        "causal": "causal",
        "bool": _left_padded_mask(2, 9, 37),
        "additive": mx.random.normal((2, 1, 9, 37), key=mx.random.key(3)),
    }[mask_kind]
    _close(
        plain_attention(q, k, v, scale=scale, mask=mask),
        FUSED(q, k, v, scale=scale, mask=mask),
        1e-4,
    )


def test_sinks_as_mlx_counts_them():
    q, k, v = _qkv(kv_heads=2)
    sinks = mx.random.normal((8,), key=mx.random.key(4))
    want = FUSED(q, k, v, scale=0.125, mask="causal", sinks=sinks)
    _close(plain_attention(q, k, v, scale=0.125, mask="causal", sinks=sinks), want, 1e-4)


def test_half_precision_stays_half_and_close():
    q, k, v = _qkv(dtype=mx.bfloat16)
    mask = _left_padded_mask(2, 9, 37)
    got = short_query_attention(q, k, v, scale=0.125, mask=mask)
    _close(got, FUSED(q, k, v, scale=0.125, mask=mask), 0.05)


def test_only_short_half_precision_queries_are_computed_plainly(monkeypatch):
    calls: list[tuple] = []

    def fused(q, k, v, **kw):
        calls.append(q.shape)
        return FUSED(q, k, v, **kw)

    monkeypatch.setattr(cuda_attention, "_FUSED", fused)
    plain = [(9, mx.bfloat16), (2, mx.float16), (3, mx.bfloat16), (64, mx.bfloat16)]
    fused_ones = [(1, mx.bfloat16), (65, mx.bfloat16), (9, mx.float32)]
    for length, dtype in plain + fused_ones:
        q, k, v = _qkv(length=length, keys=80, dtype=dtype)
        out = short_query_attention(q, k, v, scale=0.125, mask="causal")
        assert out.shape == q.shape
    assert [shape[2] for shape in calls] == [1, 65, 9]
    calls.clear()
    q, k, v = _qkv(dtype=mx.bfloat16)
    short_query_attention(q, k, v, scale=0.125, mask="causal", force_fused=False, stream=mx.cpu)
    monkeypatch.setattr(cuda_attention, "MAX_SCORES", 100)
    short_query_attention(q, k, v, scale=0.125, mask="causal")
    assert len(calls) == 2  # an explicit stream; scores over the limit


def test_install_patches_only_where_asked(monkeypatch):
    monkeypatch.setattr(cuda_attention, "on_cuda_gpu", lambda: False)
    try:
        assert cuda_attention.install() is None
        assert mx.fast.scaled_dot_product_attention is FUSED
        line = cuda_attention.install(True)
        assert line is not None and "2-64" in line
        assert mx.fast.scaled_dot_product_attention is short_query_attention
        assert cuda_attention.install(True) == line  # twice: still one wrapper
        q, k, v = _qkv(dtype=mx.bfloat16)
        got = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
        _close(got, FUSED(q, k, v, scale=0.125, mask="causal"), 0.05)
    finally:
        cuda_attention.uninstall()
    assert mx.fast.scaled_dot_product_attention is FUSED


def test_the_loader_s_cuda_paths_include_it_only_on_cuda(monkeypatch):
    from mlx_server.models import cuda_paths

    monkeypatch.setattr(cuda_paths, "install_gated_delta", lambda model: None)
    monkeypatch.setattr(cuda_attention, "on_cuda_gpu", lambda: False)
    assert cuda_paths.install_cuda_paths(object()) == []
    assert mx.fast.scaled_dot_product_attention is FUSED
    monkeypatch.setattr(cuda_attention, "on_cuda_gpu", lambda: True)
    try:
        (line,) = cuda_paths.install_cuda_paths(object())
        assert line.startswith("Attention: queries of 2-64 tokens")
        assert mx.fast.scaled_dot_product_attention is short_query_attention
    finally:
        cuda_attention.uninstall()


@pytest.mark.parametrize(
    "family", ["llama3", "qwen3", "gemma3_text", "gpt_oss", "deepseek_v3", "qwen3_5", "phi3"]
)
def test_every_family_s_chunk_after_a_prefix_is_the_same_with_it(family, tmp_path, monkeypatch):
    """A model's 9-token pass after a cached prefix (a verify pass's shape) in bfloat16 gives
    the same logits with short queries computed plainly: sliding windows, sinks (gpt-oss),
    MLA (DeepSeek V3), a hybrid (Qwen3.5), each through the patched function."""
    from arch_models import build
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(str(build(family, tmp_path / family)))[:2]
    model.set_dtype(mx.bfloat16)
    for _, module in model.named_modules():  # MLX's CPU runs an MoE's gather_mm in float32
        if type(module).__name__.startswith("Switch"):
            module.set_dtype(mx.float32)
    prompt = mx.array([[3 + (i * 7) % 50 for i in range(40)]])

    def logits() -> mx.array:
        cache = make_prompt_cache(model)
        model(prompt[:, :31], cache=cache)
        out = model(prompt[:, 31:], cache=cache).astype(mx.float32)
        mx.eval(out)
        return out

    want = logits()
    plain: list[int] = []
    real = cuda_attention.plain_attention

    def counted(*a, **kw):
        plain.append(a[0].shape[2])
        return real(*a, **kw)

    monkeypatch.setattr(cuda_attention, "plain_attention", counted)
    try:
        cuda_attention.install(True)
        got = logits()
    finally:
        cuda_attention.uninstall()
    assert set(plain) == {31, 9}  # the prefix's and the chunk's attention went the plain way
    np.testing.assert_allclose(np.array(got), np.array(want), atol=0.05, rtol=0.05)
