"""Admission against all the memory the engine holds, not only the running requests' KV.

The budget (``--kv-budget-gb``) covers: the KV admitted for running sequences (an estimate:
prompt plus ``max_tokens``), the prefix cache's RAM tier, KV states waiting to be written to
the disk tier, and MLX's buffer cache (freed buffers kept for reuse). When a request would
take the total over the budget, memory is given back first — the buffer cache is cleared and
the prefix cache evicts entries (to disk when it has a disk tier) — and only then does the
request wait for running ones to finish.
"""

from __future__ import annotations

from typing import Any


def _buffer_cache_bytes() -> int:
    import mlx.core as mx

    return int(mx.get_cache_memory())


def _clear_buffer_cache() -> None:
    import mlx.core as mx

    mx.clear_cache()


_configured_cache_limit: int | None = None  # --cache-limit-gb, read once per process


def _buffer_cache_cap() -> int:
    """The buffer-cache limit set at start (later limits here only lower it)."""
    global _configured_cache_limit
    if _configured_cache_limit is None:
        _configured_cache_limit = _set_buffer_cache_limit(0)
        _set_buffer_cache_limit(_configured_cache_limit)
    return _configured_cache_limit


def _set_buffer_cache_limit(n_bytes: int) -> int:
    import mlx.core as mx

    return int(mx.set_cache_limit(n_bytes))


class MemoryBudget:
    """Decides whether a request's KV fits, making room when it can."""

    def __init__(self, budget_bytes: int, prefix_cache: Any = None, running: Any = None):
        """``running``: a callable giving the KV bytes admitted for running sequences; with
        it, an entry stored in the prefix cache past the budget evicts older ones at once."""
        self.budget = budget_bytes
        self.prefix_cache = prefix_cache
        self.evicted_bytes = 0  # prefix-cache bytes given back under memory pressure
        self._running = running
        self._cache_cap = _buffer_cache_cap()
        self._cache_limit = self._cache_cap
        if prefix_cache is not None and running is not None:
            prefix_cache.on_insert = self._after_insert
        disk = getattr(prefix_cache, "disk", None)
        if disk is not None:
            # The writes waiting for the disk tier hold memory of this budget, not freed until
            # written: a sixteenth of it at most (a 16 GB Mac's budget is a few GB).
            disk.max_pending_bytes = min(disk.max_pending_bytes, budget_bytes // 16)

    def _after_insert(self) -> None:
        """Keep the prefix cache within what the budget leaves it (the newest entry stays
        if it alone fits)."""
        pc = self.prefix_cache
        excess = self._running() + self.held_bytes() - self.budget
        if excess > 0 and len(pc) > 1:
            self.evicted_bytes += pc.evict_bytes(min(excess, pc.nbytes), keep_newest=True)
        self.limit_buffer_cache(self._running())

    def limit_buffer_cache(self, kv_bytes: int) -> None:
        """Let MLX's buffer cache keep only what the budget leaves beside ``kv_bytes`` and
        the prefix cache (never more than --cache-limit-gb): freed buffers beyond it are
        released at once instead of piling up between admissions."""
        pc = self.prefix_cache
        held = (pc.nbytes + (pc.disk.pending_bytes if pc.disk is not None else 0)) if pc else 0
        limit = min(self._cache_cap, max(0, self.budget - kv_bytes - held))
        if limit != self._cache_limit:
            _set_buffer_cache_limit(limit)
            self._cache_limit = limit

    def held_bytes(self) -> int:
        """Memory held besides the running sequences: prefix cache, pending disk writes,
        MLX's buffer cache."""
        held = _buffer_cache_bytes()
        pc = self.prefix_cache
        if pc is not None:
            held += pc.nbytes
            if pc.disk is not None:
                held += pc.disk.pending_bytes
        return held

    def fits(self, kv_bytes: int) -> bool:
        """Whether ``kv_bytes`` (running sequences plus the candidate) fit beside what is
        held. When they don't but would once the buffer cache is cleared and prefix-cache
        entries are evicted, that is done (no more than needed); when even that would not
        be enough, nothing is given back (the request waits for running ones)."""
        cache = _buffer_cache_bytes()
        pc = self.prefix_cache
        ram = pc.nbytes if pc is not None else 0
        excess = kv_bytes + self.held_bytes() - self.budget
        if excess <= 0:
            self.limit_buffer_cache(kv_bytes)
            return True
        if excess > cache + ram:
            return False
        if cache:
            _clear_buffer_cache()
        if excess > cache and pc is not None:
            self.evicted_bytes += pc.evict_bytes(excess - cache)
            _clear_buffer_cache()  # evicted arrays land in the buffer cache
        fits = kv_bytes + self.held_bytes() <= self.budget
        if fits:
            self.limit_buffer_cache(kv_bytes)
        return fits

    def stats(self) -> dict[str, int]:
        import mlx.core as mx

        return {
            "memory_budget_bytes": self.budget,
            "memory_active_bytes": int(mx.get_active_memory()),
            "memory_buffer_cache_bytes": _buffer_cache_bytes(),
            "memory_prefix_cache_evicted_bytes": self.evicted_bytes,
        }
