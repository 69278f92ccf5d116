"""The prefix cache's side of its disk tier (``disk.DiskPromptCache``): entries served from
disk, reads started ahead on the loader thread so the engine admits a request only once its
file is in host memory, entries handed to the tier, and what RAM holds written at close."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from mlx_lm.models.cache import trim_prompt_cache

from mlx_server.engine.cache.faults import CacheFaults

if TYPE_CHECKING:
    from mlx_server.engine.cache.disk import DiskPromptCache

_MAX_READS = 2  # disk entries held in host memory, read ahead of their requests' admission
_STALE_READ_S = 60.0  # a read not taken by then belongs to a request that went away


class DiskSide:
    """Reads ahead and writes for one prefix cache; failures are the cache's ``faults``."""

    def __init__(self, disk: DiskPromptCache, faults: CacheFaults):
        self.disk = disk
        self._faults = faults
        self._reads: dict[str, tuple[Any, float]] = {}  # disk entry -> (future, started)

    def fetch(self, tokens: list[int], floor: int) -> tuple[list[Any], list[int]] | None:
        """``tokens`` served from disk when the tier covers more than ``floor`` of them:
        the KV state and the tokens left to prefill. None on a miss or an unreadable entry."""
        disk = self.disk
        while (found := disk.lookup(tokens, floor)) is not None:
            loaded = self._take_read(found[0])
            if loaded is None:
                loaded = disk.load(found[0])  # None: unreadable, and gone; try the next
            if loaded is not None:
                break
        else:
            disk.misses += 1
            return None
        # Not copied into RAM as well: the request's own state is stored when it ends.
        cache, entry_tokens, _ = loaded
        keep = found[1]
        if len(entry_tokens) > keep:
            trim_prompt_cache(cache, len(entry_tokens) - keep)
        return cache, tokens[keep:]

    def covers(self, tokens: list[int], floor: int) -> int:
        """How many leading tokens of ``tokens`` the tier would serve (``floor`` if no more)."""
        found = self.disk.lookup(tokens, floor)
        return found[1] if found is not None else floor

    def read_ahead(self, tokens: list[int], floor: int, on_loaded: Any) -> bool:
        """Whether ``fetch(tokens, floor)`` can run without waiting for a file; if not, its
        read starts on the loader thread (once; ``on_loaded`` is called when it is done)."""
        found = self.disk.lookup(tokens, floor)
        if found is None or self.disk.is_queued(found[0]):
            return True
        read = self._reads.get(found[0])
        if read is None:
            self._drop_stale_reads()
            if len(self._reads) >= _MAX_READS:
                return True  # no room to read ahead: fetch reads it (the old, blocking way)
            self._reads[found[0]] = (self.disk.read_async(found[0], on_loaded), time.monotonic())
            return False
        return bool(read[0].done())

    def _drop_stale_reads(self) -> None:
        """Forget reads done long ago and never taken (their requests were cancelled)."""
        now = time.monotonic()
        for name, (future, started) in list(self._reads.items()):
            if future.done() and now - started > _STALE_READ_S:
                del self._reads[name]

    @property
    def loading(self) -> bool:
        """Whether a disk read is in flight."""
        return any(not future.done() for future, _ in self._reads.values())

    def _take_read(self, name: str) -> tuple[list[Any], list[int], str] | None:
        """The entry ``read_ahead`` read off the engine thread, as MLX arrays; None if none."""
        future, _ = self._reads.pop(name, (None, 0.0))
        if future is None or not future.done() or (read := future.result()) is None:
            return None
        cache = self.disk.materialize(read)
        return (cache, read.tokens, read.kind) if cache is not None else None

    def save(self, tokens: list[int], cache: list[Any], kind: str) -> bool:
        """Hand an entry to the tier; a failure drops it there, logged once."""
        try:
            return self.disk.save(tokens, cache, kind)
        except Exception as e:
            self._faults.note("writing an entry to disk", e)
            return False

    def settle(self, everything: bool = False) -> None:
        """Hand the writer the states whose arrays are computed by now (``DiskPromptCache.settle``);
        a failure drops them there, logged once."""
        try:
            self.disk.settle(everything)
        except Exception as e:
            self._faults.note("writing an entry to disk", e)

    def close(self, entries: Callable[[], Iterable[tuple[list[int], Any]]], timeout: float) -> None:
        """Write ``entries()`` (tokens and cache entries, most valuable first) and close the
        tier, waiting at most ``timeout`` seconds in all."""
        self.disk.mark_closing()  # a server restarted meanwhile waits for the folder
        deadline = time.monotonic() + timeout
        for tokens, entry in entries():
            if time.monotonic() >= deadline:
                break
            while not self.save(tokens, entry.prompt_cache, entry.cache_type):
                if not self.disk.busy or time.monotonic() >= deadline:
                    break
                time.sleep(0.01)  # the writer queue is full: wait for a slot
        self.disk.close(max(0.0, deadline - time.monotonic()))
