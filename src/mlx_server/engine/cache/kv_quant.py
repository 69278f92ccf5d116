"""Quantized KV cache that works with mlx-lm's ``BatchGenerator``.

mlx-lm (0.32) has ``QuantizedKVCache`` for one sequence but no batched form:
``BatchGenerator`` merges the caches of the sequences it prefills together with the first
cache's ``merge`` classmethod, and ``QuantizedKVCache`` has none ("does not yet support
batching with history"). This module adds the two missing pieces:

- ``BatchableQuantizedKVCache``: mlx-lm's per-sequence quantized cache plus ``merge``;
- ``BatchQuantizedKVCache``: the batched cache (left-padded like ``BatchKVCache``) that
  stores keys and values as ``mx.quantize`` triples (packed data, scales, biases). It has
  ``bits`` and ``group_size``, so the models' attention takes mlx-lm's quantized path.

``QuantizedKVModel`` wraps a model so that ``make_prompt_cache`` (which ``BatchGenerator``
calls for a sequence without a cache) builds quantized layers: nothing else in the engine
changes, and the prefix cache stores and returns quantized per-sequence states.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    _BaseCache,
    dynamic_roll,
    make_prompt_cache,
)

Triple = tuple[Any, Any, Any]


def _tmap(fn: Any, *xs: Triple) -> Triple:
    return tuple(fn(*parts) for parts in zip(*xs, strict=True))


class BatchableQuantizedKVCache(QuantizedKVCache):
    """A one-sequence quantized KV cache that ``BatchGenerator`` can batch."""

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKVCache:
        return BatchQuantizedKVCache.merge(caches)


class BatchQuantizedKVCache(_BaseCache):
    """Batched, left-padded quantized KV cache (the quantized twin of ``BatchKVCache``)."""

    step = 256

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8):
        self.keys: Triple | None = None
        self.values: Triple | None = None
        self.left_padding: Any = mx.array(left_padding)
        self.offset: Any = mx.array([-p for p in left_padding])
        self._idx = 0
        self._right_padding: Any = None
        self.group_size = group_size
        self.bits = bits

    def _quantize(self, x: Any) -> Triple:
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))  # type: ignore[return-value]

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Triple, Triple]:
        prev = self._idx
        n = keys.shape[2]
        qk, qv = self._quantize(keys), self._quantize(values)
        if self.keys is None or self.values is None or prev + n > self.keys[0].shape[2]:
            steps = (self.step + n - 1) // self.step * self.step

            def grow(old: Any, new: Any) -> Any:
                shape = (new.shape[0], new.shape[1], steps, new.shape[3])
                fresh = mx.zeros(shape, dtype=new.dtype)
                if old is None:
                    return fresh
                return mx.concatenate([old[..., :prev, :], fresh], axis=2)

            none: Triple = (None, None, None)
            self.keys = _tmap(grow, self.keys or none, qk)
            self.values = _tmap(grow, self.values or none, qv)
        self.offset = self.offset + n
        self._idx += n
        assert self.keys is not None and self.values is not None
        for buf, new in zip(self.keys + self.values, qk + qv, strict=True):
            buf[..., prev : self._idx, :] = new
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Triple, Triple]:
        assert self.keys is not None and self.values is not None
        cut = self._idx
        return _tmap(lambda x: x[..., :cut, :], self.keys), _tmap(
            lambda x: x[..., :cut, :], self.values
        )

    def prepare(
        self, *, left_padding: Any = None, lengths: Any = None, right_padding: Any = None
    ) -> None:
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left padding can only be added to an empty cache")
            pad = mx.array(left_padding)
            self.left_padding += pad
            self.offset = self.offset - pad
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self) -> None:
        if self._right_padding is not None and self.keys is not None and self.values is not None:
            shift = self._right_padding[:, None]
            self.keys = _tmap(lambda x: dynamic_roll(x, shift, axis=2), self.keys)
            self.values = _tmap(lambda x: dynamic_roll(x, shift, axis=2), self.values)
            self.offset = self.offset - self._right_padding
            self.left_padding += self._right_padding
        self._right_padding = None

    @property
    def state(self) -> Any:
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: Any) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def filter(self, batch_indices: Any) -> None:
        if self.keys is not None and self.values is not None:
            self.keys = _tmap(lambda x: x[batch_indices], self.keys)
            self.values = _tmap(lambda x: x[batch_indices], self.values)
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = int(min(self.left_padding.tolist()))
        if shift > 0:
            if self.keys is not None and self.values is not None:
                self.keys = _tmap(lambda x: x[..., shift:, :], self.keys)
                self.values = _tmap(lambda x: x[..., shift:, :], self.values)
            self._idx -= shift
            self.left_padding -= shift

    def extend(self, other: BatchQuantizedKVCache) -> None:
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        ref = self.keys if self.keys is not None else other.keys
        vref = self.values if self.values is not None else other.values
        assert ref is not None and vref is not None
        max_idx = max(self._idx, other._idx)
        max_len = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        def pad(c: BatchQuantizedKVCache) -> tuple[Triple, Triple, Any, Any]:
            left = max_idx - c._idx
            b = c.offset.shape[0]

            def one(x: Any, like: Any) -> Any:
                if x is None:
                    x = mx.zeros((b, like.shape[1], 0, like.shape[3]), dtype=like.dtype)
                right = max_len - x.shape[2] - left
                if right < 0:
                    x, right = x[..., :right, :], 0
                if left or right:
                    x = mx.pad(x, [(0, 0), (0, 0), (left, right), (0, 0)])
                return x

            none: Triple = (None, None, None)
            k = _tmap(one, c.keys or none, ref)
            v = _tmap(one, c.values or none, vref)
            return k, v, c.offset, c.left_padding + left

        (k1, v1, o1, l1), (k2, v2, o2, l2) = pad(self), pad(other)
        self.keys = _tmap(lambda a, b: mx.concatenate([a, b]), k1, k2)
        self.values = _tmap(lambda a, b: mx.concatenate([a, b]), v1, v2)
        self.offset = mx.concatenate([o1, o2])
        self.left_padding = mx.concatenate([l1, l2])
        self._idx = max_idx

    def extract(self, idx: int) -> BatchableQuantizedKVCache:
        assert self.keys is not None and self.values is not None
        pad = int(self.left_padding.tolist()[idx])
        cut = self._idx

        def take(x: Any) -> Any:
            return mx.contiguous(x[idx : idx + 1, :, pad:cut])

        c: Any = BatchableQuantizedKVCache(group_size=self.group_size, bits=self.bits)
        c.keys, c.values = _tmap(take, self.keys), _tmap(take, self.values)
        c.offset = cut - pad
        return c

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKVCache:
        lengths = [c.offset if c.keys is not None else 0 for c in caches]
        first = caches[0]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        out = cls(padding, group_size=first.group_size, bits=first.bits)
        if longest == 0:
            return out
        like_k = next(c.keys for c in caches if c.keys is not None)
        like_v = next(c.values for c in caches if c.values is not None)
        B = len(caches)

        def blank(x: Any) -> Any:
            return mx.zeros((B, x.shape[1], longest, x.shape[3]), dtype=x.dtype)

        keys, values = _tmap(blank, like_k), _tmap(blank, like_v)
        for i, (p, n, c) in enumerate(zip(padding, lengths, caches, strict=True)):
            if not n:
                continue
            for buf, src in zip(keys + values, tuple(c.keys) + tuple(c.values), strict=True):
                buf[i : i + 1, :, p : p + n] = src[..., :n, :]
        out.keys, out.values = keys, values
        out.offset = out.offset + longest
        out._idx = longest
        return out

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return sum(x.nbytes for x in self.keys + self.values)


def quantize_layers(
    cache: list[Any], group_size: int, bits: int, layers: list[int] | None = None
) -> list[Any]:
    """The cache with its ``layers`` (by index; default every plain KV layer) replaced by
    batchable quantized ones; the rest (recurrent, sliding-window, or a layer the model's
    quantized attention cannot take: ``kv_quant_layers``) are kept as they are."""
    chosen = set(layers) if layers is not None else None
    return [
        BatchableQuantizedKVCache(group_size=group_size, bits=bits)
        if type(c) is KVCache and (chosen is None or i in chosen)
        else c
        for i, c in enumerate(cache)
    ]


class QuantizedKVModel:
    """A model whose fresh prompt caches are quantized (``BatchGenerator`` builds a
    sequence's cache with ``make_prompt_cache(model)``, which asks ``model.make_cache``);
    ``layers``: which cache layers (default every plain KV layer)."""

    def __init__(
        self, model: Any, bits: int, group_size: int = 64, layers: list[int] | None = None
    ):
        self._model = model
        self.kv_bits = bits
        self.kv_group_size = group_size
        self.kv_layers = layers

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._model(*args, **kwargs)

    def make_cache(self) -> list[Any]:
        return quantize_layers(
            make_prompt_cache(self._model), self.kv_group_size, self.kv_bits, self.kv_layers
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)
