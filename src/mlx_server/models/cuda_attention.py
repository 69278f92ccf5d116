"""Short queries' attention on a CUDA GPU, without a cuDNN graph for each new shape.

On CUDA, MLX's fused attention for a query of 2 tokens or more in half precision is
cuDNN's (its vector kernel takes one token, a decode step), and cuDNN builds a graph for each new combination of query length, key length and cache layout
(MLX keeps the graphs in a cache keyed by the exact shapes and strides): tens of
milliseconds each on a warm machine, seconds on a fresh one. A speculative verify pass
(k + 1 tokens after a cache that grows every step) and a short prefill chunk after a
cached prefix meet a key length not seen before almost every time, so each of them paid
for a graph: on an H100 a verify pass of 9 tokens cost 11 to 21 plain decode steps where
the same pass at a seen shape costs 1.1 to 1.5 (`bench/results/gpu-2026-12-06-speculative-
h100.jsonl`). Such a query is small. Computed plainly (MLX's own unfused attention, the one
the CPU runs: scaled scores, the mask, a softmax in float32, the values), it costs less
than one graph build, and its matrix products build nothing per shape.

``install()`` puts ``short_query_attention`` in front of
``mx.fast.scaled_dot_product_attention`` for query lengths 2 to ``SHORT_QUERY`` (a decode
step's single token keeps MLX's vector kernel; a longer prefill chunk cuDNN's flash
attention), in
half precision (what cuDNN takes; float32 already runs unfused), and only while the
scores stay small (``MAX_SCORES``). Only on a CUDA GPU: Metal's and the CPU's kernels are
not built per shape, and there nothing changes.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_server.models.gated_delta_cuda import on_cuda_gpu

SHORT_QUERY = 64  # longest query (tokens) computed plainly
MAX_SCORES = 1 << 26  # batch x heads x query x keys: 128 MiB of half-precision scores
_MARK = "mlx_server_short_query"


def short_query_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: Any = None,
    sinks: mx.array | None = None,
    **kwargs: Any,
) -> mx.array:
    """``mx.fast.scaled_dot_product_attention``, computed plainly for a short query (see the
    module docstring); any other call goes to MLX's fused attention unchanged."""
    if not _plain(q, k, v, mask, kwargs):
        return _FUSED(q, k, v, scale=scale, mask=mask, sinks=sinks, **kwargs)
    return plain_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


def _plain(q: mx.array, k: mx.array, v: mx.array, mask: Any, kwargs: dict[str, Any]) -> bool:
    if kwargs.get("force_fused") or kwargs.get("stream") is not None:
        return False
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or not 2 <= q.shape[2] <= SHORT_QUERY:
        return False
    if q.dtype not in (mx.float16, mx.bfloat16) or q.shape[1] % k.shape[1]:
        return False
    if isinstance(mask, str) and mask != "causal":
        return False
    return q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] <= MAX_SCORES


def plain_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: Any = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Attention as MLX computes it where no fused kernel serves (its fallback): grouped
    query heads against their key head, a boolean mask as the dtype's lowest value, sinks
    as one more logit per head, the softmax in float32."""
    dtype = mx.result_type(q, k, v)
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    batch, heads, length, _ = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    repeats = heads // kv_heads
    q = q * mx.array(scale, dtype=dtype)
    if repeats > 1:
        q = q.reshape(batch, kv_heads, repeats, length, q.shape[-1])
        k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    scores = q @ mx.swapaxes(k, -1, -2)
    if mask is not None:
        if isinstance(mask, str):  # "causal": the query is the last ``length`` positions
            rows = mx.arange(keys - length, keys)[:, None]
            mask = rows >= mx.arange(keys)[None, :]
        elif mask.dtype != mx.bool_:
            mask = mask.astype(dtype)
        mask = mx.broadcast_to(mask, (batch, heads, length, keys))
        if repeats > 1:
            mask = mask.reshape(batch, kv_heads, repeats, length, keys)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(dtype).min, dtype=dtype))
        else:
            scores = scores + mask
    if sinks is not None:
        sink = sinks.astype(dtype).reshape(1, heads, 1, 1)
        if repeats > 1:
            sink = sink.reshape(1, kv_heads, repeats, 1, 1)
        sink = mx.broadcast_to(sink, (*scores.shape[:-1], 1))
        scores = mx.concatenate([sink, scores], axis=-1)
    weights = mx.softmax(scores, axis=-1, precise=True)
    if sinks is not None:
        weights = weights[..., 1:]
    out = weights @ v
    if repeats > 1:
        out = out.reshape(batch, heads, length, out.shape[-1])
    return out


_FUSED = mx.fast.scaled_dot_product_attention
setattr(short_query_attention, _MARK, True)


def install(enabled: bool | None = None) -> str | None:
    """Route short queries' attention around cuDNN (see the module docstring). ``enabled``:
    None for "on a CUDA GPU only"; tests pass True. Returns a line for the log, or None
    where nothing changed."""
    if not (on_cuda_gpu() if enabled is None else enabled):
        return None
    if not getattr(mx.fast.scaled_dot_product_attention, _MARK, False):
        mx.fast.scaled_dot_product_attention = short_query_attention
    return f"queries of 2-{SHORT_QUERY} tokens computed plainly (no cuDNN graph per shape)"


def uninstall() -> None:
    """Give MLX its own function back (tests)."""
    mx.fast.scaled_dot_product_attention = _FUSED
