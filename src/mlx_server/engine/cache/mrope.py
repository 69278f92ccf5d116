"""A KV cache kind for Qwen-VL: its multimodal rotary positions (M-RoPE) in the batch.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL give an image's tokens positions on a grid (time,
height, width), so the positions after an image run behind the token count: each
sequence's text goes on at ``offset + delta``, its own ``delta`` (mlx-vlm's ``rope_deltas``; 0 without media).
mlx-vlm keeps that on the model, for one sequence; here each sequence's cache carries it
(``DeltaKVCache``), through the batch's merges, splits and filters and into the prefix
cache, and ``positions`` builds the batch's position ids from the cache: with the same
position on all three axes, text tokens rotate as with plain RoPE.
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

# Families whose language model takes explicit (3, batch, length) position ids this way.
MROPE_FAMILIES = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl"}


class DeltaKVCache(KVCache):
    """A sequence's KV cache and its position delta."""

    def __init__(self, delta: int = 0):
        super().__init__()
        self.delta = delta

    @classmethod
    def merge(cls, caches: list[Any]) -> DeltaBatchKVCache:
        return DeltaBatchKVCache.merge(caches)

    # The delta is part of the state, so that the disk tier keeps it (cache/serialize.py).
    @property
    def state(self) -> Any:
        return self.keys, self.values, self.offset, self.delta

    @state.setter
    def state(self, v: Any) -> None:
        self.keys, self.values, self.offset = v[:3]
        self.delta = int(v[3]) if len(v) > 3 else 0


class DeltaBatchKVCache(BatchKVCache):
    """A batch's KV cache and each row's position delta."""

    deltas: mx.array

    def __init__(self, left_padding: list[int]):
        super().__init__(left_padding)
        self.deltas = mx.zeros((len(left_padding),), dtype=mx.int32)

    @classmethod
    def merge(cls, caches: list[Any]) -> DeltaBatchKVCache:
        merged = super().merge(caches)
        out = cls.__new__(cls)
        out.__dict__.update(merged.__dict__)
        out.deltas = mx.array([getattr(c, "delta", 0) for c in caches], dtype=mx.int32)
        return out

    def filter(self, batch_indices: Any) -> None:
        super().filter(batch_indices)
        self.deltas = self.deltas[mx.array(batch_indices)]

    def extend(self, other: Any) -> None:
        super().extend(other)
        self.deltas = mx.concatenate([self.deltas, other.deltas])

    def extract(self, idx: int) -> DeltaKVCache:
        plain = super().extract(idx)
        out = DeltaKVCache(first_int(self.deltas[idx]))
        out.keys, out.values, out.offset = plain.keys, plain.values, plain.offset
        return out


def starts(cache: list[Any]) -> mx.array | int:
    """Each row's next text position: a batch's (batch,) array, a lone sequence's int."""
    c = cache[0]
    if isinstance(c, DeltaBatchKVCache):
        return c.offset + c.deltas
    return int(c.offset) + getattr(c, "delta", 0)


def positions(cache: list[Any], length: int) -> mx.array:
    """Position ids (3, batch, length) for the next ``length`` tokens of each row."""
    start = starts(cache)
    if isinstance(start, int):
        start = mx.array([start])
    pos = start[:, None] + mx.arange(length)[None, :]
    return mx.broadcast_to(pos[None], (3, *pos.shape))


def first_int(a: Any) -> int:
    """The first element of an array (or a number) as an int."""
    return int(cast(int, mx.array(a).reshape(-1)[0].item()))


def set_delta(cache: list[Any], delta: int) -> None:
    """Record a sequence's delta (after its prompt's media) on every layer's cache."""
    for c in cache:
        c.delta = delta
