"""Roll a cache back after a verify pass, on every kind of cache layer.

A verify pass feeds the target ``k + 1`` tokens and keeps only a prefix of them. A plain
KV layer drops the rest by trimming. Other layers cannot always: a recurrent layer
(``ArraysCache``: Mamba, gated delta, short convolutions) holds one state that has
absorbed every token, and a sliding-window layer (``RotatingKVCache``) stops being
trimmable once it is full (mlx-lm's ``trim_prompt_cache`` then trims nothing and returns
0). So before the pass ``Rollback`` saves those layers (references to their arrays: no
copy, MLX arrays are values); to keep a prefix it trims when every layer can be trimmed,
and otherwise restores the saved state and feeds the kept tokens again. Every trim's
count is checked: a cache that cannot be put back raises, it never serves a wrong context.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, _BaseCache

from mlx_server.engine.cache.kv_quant import BatchableQuantizedKVCache

# Layers whose trim is always exact: they need no saved state.
_TRIMS_EXACTLY = (KVCache, QuantizedKVCache, BatchableQuantizedKVCache)


class RollbackError(RuntimeError):
    """A cache could not be put back to the accepted context."""


def _freeze(value: Any) -> Any:
    """A copy of ``value`` that later in-place writes to the cache do not reach: arrays are
    new handles on the same data (``stop_gradient`` shares the buffer; ``mx.array`` would
    copy it), so a write then copies instead of reusing the buffer."""
    if isinstance(value, mx.array):
        return mx.stop_gradient(value)
    if isinstance(value, list):
        return [_freeze(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, _BaseCache):
        return Saved(value)  # a layer inside a layer (``CacheList``)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, Saved):
        value.restore()
        return value.layer
    if isinstance(value, mx.array):
        return mx.stop_gradient(value)
    if isinstance(value, list):
        return [_thaw(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_thaw(v) for v in value)
    return value


class Saved:
    """One cache layer's attributes at a point in time."""

    def __init__(self, layer: Any):
        self.layer = layer
        self.attrs = {k: _freeze(v) for k, v in vars(layer).items()}

    def restore(self) -> None:
        # Thawed again on each restore, so the saved state can be restored more than once.
        for k, v in self.attrs.items():
            setattr(self.layer, k, _thaw(v))


def needs_saving(layer: Any) -> bool:
    """Whether a layer may not be trimmable after a pass (so its state is saved first)."""
    return type(layer) not in _TRIMS_EXACTLY


def checked_trim(cache: list[Any], n: int) -> None:
    """Trim every layer by ``n``; raise unless each trimmed exactly ``n``."""
    if n <= 0:
        return
    if not all(c.is_trimmable() for c in cache):
        kinds = sorted({type(c).__name__ for c in cache if not c.is_trimmable()})
        raise RollbackError(f"cannot trim {n} tokens from a cache with {', '.join(kinds)}")
    for c in cache:
        got = c.trim(n)
        if got != n:
            raise RollbackError(f"{type(c).__name__} trimmed {got} of {n} tokens")


class Rollback:
    """A cache's state at one point, and the tokens fed after it (``feed``); ``keep(n)``
    leaves the cache holding the first ``n`` of those tokens."""

    def __init__(self, model: Any, cache: list[Any]):
        self.model, self.cache = model, cache
        self.fed: list[int] = []  # fed after the saved point; the cache holds all of them
        self._saved = [Saved(c) if needs_saving(c) else None for c in cache]

    def feed(self, tokens: list[int]) -> mx.array:
        """Feed ``tokens`` after those fed so far: the model's logits at each, (n, vocab)."""
        self.fed += tokens
        return self.model(mx.array(tokens)[None], cache=self.cache)[0]

    def feed_array(self, tokens: mx.array, values: list[int]) -> mx.array:
        """``feed`` for tokens that may not be computed yet (an array the device has yet to
        produce: a pass queued behind another); ``values`` stands for them in ``fed``. Only
        for a cache that trims exactly (``needs_saving`` of no layer): a restore would feed
        ``values`` again."""
        self.fed += values
        return self.model(tokens[None], cache=self.cache)[0]

    def keep(self, n: int) -> None:
        """Leave the cache holding the first ``n`` tokens fed (trimmed if every layer can
        be, else restored and fed them again)."""
        drop = len(self.fed) - n
        if drop <= 0:
            return
        if all(c.is_trimmable() for c in self.cache):
            checked_trim(self.cache, drop)
        else:
            self._restore_and_feed(n)
        del self.fed[n:]

    def _restore_and_feed(self, n: int) -> None:
        for layer, saved in zip(self.cache, self._saved, strict=True):
            if saved is not None:
                saved.restore()
            else:
                checked_trim([layer], len(self.fed))
        if n:
            self.model(mx.array(self.fed[:n])[None], cache=self.cache)


def rollback_problem(cache: list[Any]) -> str | None:
    """Why speculation cannot roll back a fresh ``cache`` of the model, or None. Every
    mlx-lm cache layer (a ``_BaseCache``) is saved and restored by its attributes; a layer
    of another kind may keep state this module does not know how to save."""
    odd = sorted({type(c).__name__ for c in cache if not isinstance(c, _BaseCache)})
    if odd:
        return f"its cache has layers of a kind speculation cannot roll back ({', '.join(odd)})"
    return None


def layer_kinds(cache: list[Any]) -> str:
    """The cache's layer kinds, with counts: ``"3 KVCache, 1 ArraysCache"``."""
    counts: dict[str, int] = {}
    for c in cache:
        counts[type(c).__name__] = counts.get(type(c).__name__, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in counts.items())
