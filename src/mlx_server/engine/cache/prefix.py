"""The prefix cache: KV states of earlier prompts, looked up by longest shared token prefix.

Built on mlx-lm's ``LRUPromptCache`` (a token trie with entry and byte limits), with three
changes the server needs:

- a lookup never returns an empty remainder: the last prompt token is always fed to the
  model, since its logits give the first generated token (an exact hit is trimmed by one);
- a hit refreshes the entry it used, so eviction is least-recently-*used*;
- system-prompt entries (``kind="system"``) are evicted only when no conversation entry is
  left (or when they would take more than half the slots), and a longer conversation
  inserted on top of one does not replace it. A shared system prompt therefore stays warm
  for new conversations after their turns age out.

With a disk tier (``disk_cache.DiskPromptCache``), entries that leave RAM and system-prompt
entries are also written to disk, a lookup that the disk serves better than RAM loads the
entry from there, and ``close`` writes what RAM still holds. ``prepare`` reads such an entry
on the disk tier's loader thread first, so the engine admits the request only once the file
is in host memory, and running streams do not wait for the disk.

An entry larger than the whole RAM tier cannot stay in it: it goes to the disk tier (or,
without one, is dropped), and either way it is logged and counted (``prompt_cache_oversize``).
"""

from __future__ import annotations

import copy
import time
from typing import TYPE_CHECKING, Any

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from mlx_server.engine.cache.faults import CacheFaults
from mlx_server.engine.cache.misses import MissLog, worth
from mlx_server.logs import log

_KEY = "model"  # one model per engine: a constant trie namespace
_MAX_READS = 2  # disk entries held in host memory, read ahead of their requests' admission
_STALE_READ_S = 60.0  # a read not taken by then belongs to a request that went away
SYSTEM = "system"
CONVERSATION = "assistant"
# The state at a prompt's end, before generation, for caches that cannot be trimmed: evicted
# after the finished conversations' states (which serve a next turn only when it repeats the
# answer token for token), before system prompts.
CHECKPOINT = "user"

if TYPE_CHECKING:
    from mlx_server.engine.cache.disk import DiskPromptCache


class _SystemLast(LRUPromptCache.CacheOrder):
    """Eviction order: oldest conversation entry first, system-prompt entries last."""

    def pop(self) -> tuple[Any, list[int]]:
        for kind in ("assistant", "user", SYSTEM):
            if self._lrus[kind]:
                return self._lrus[kind].popleft()
        raise IndexError("the prefix cache is empty")

    def touch(self, model: Any, tokens: list[int]) -> None:
        """Move an entry to the most-recently-used end of its queue."""
        for lru in self._lrus.values():
            try:
                lru.remove((model, tokens))
            except ValueError:
                continue
            lru.append((model, tokens))
            return

    def kind_of(self, model: Any, tokens: list[int]) -> str | None:
        for kind, lru in self._lrus.items():
            if (model, tokens) in lru:
                return kind
        return None


class PrefixCache(LRUPromptCache):
    """Prompt KV states bounded by entry count and bytes; see the module docstring."""

    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        disk: DiskPromptCache | None = None,
        disk_off_reason: str = "",
    ):
        super().__init__(max_entries, max_bytes)
        self._lru: _SystemLast = _SystemLast()
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.disk = disk
        self.disk_off_reason = disk_off_reason  # why there is no disk tier (for /health)
        self.on_insert: Any = None  # called after each insert (the memory budget's check)
        self.on_loaded: Any = None  # called (on the loader thread) when a disk read is done
        # Called with ("store", tokens, kind) when an entry enters the trie and ("evict",
        # tokens, kind) when one leaves it by eviction: what other ranks replay (lockstep/).
        self.on_change: Any = None
        self.oversize = 0  # entries larger than the whole RAM tier
        self.faults = CacheFaults()  # its own failures: the entry goes, requests go on
        self.missed = MissLog()  # why each miss missed
        if disk is not None:
            self.missed.load_foreign(disk.directory)
        self._reads: dict[str, tuple[Any, float]] = {}  # disk entry -> (future, started)

    def fetch(self, tokens: list[int]) -> tuple[list[Any] | None, list[int]]:
        """A private copy of the KV state for the longest usable prefix of ``tokens`` and the
        tokens still to prefill (never empty); ``(None, tokens)`` on a miss, whose reason is
        logged and counted. An entry that fails to copy or load is dropped: a miss."""
        key: list[int] | None = None
        try:
            res = self._trie.search(_KEY, tokens)
            key, keep = self._choose(res, tokens)
            if self.disk is not None and keep < len(tokens) - 1:
                loaded = self._fetch_from_disk(tokens, keep if key is not None else 0)
                if loaded is not None:
                    return loaded
            if key is None or keep <= 0:
                self._miss(tokens, self._why_missed(res, tokens))
                return None, tokens
            cache = copy.deepcopy(self._trie.get(_KEY, key).prompt_cache)
            # mlx-lm annotates the count it returns as a list
            trimmed: Any = trim_prompt_cache(cache, len(key) - keep) if len(key) > keep else 0
            if trimmed != len(key) - keep:
                raise RuntimeError("the entry could not be rewound")
        except Exception as e:
            self.faults.note("reading an entry", e)
            if key is not None:
                self.forget(key)
            self._miss(tokens, "failed")
            return None, tokens
        self._lru.touch(_KEY, key)
        self.hits += 1
        return cache, tokens[keep:]

    def _miss(self, tokens: list[int], reason: str) -> None:
        self.misses += 1
        self.missed.miss(reason, len(tokens))

    def _why_missed(self, res: Any, tokens: list[int]) -> str:
        """The reason for a miss: an entry that cannot be rewound, one that is gone, none."""
        if res.exact is not None or (res.longer is not None and worth(res.common_prefix, tokens)):
            return "not_trimmable"
        return self.missed.gone_reason(tokens) or "no_entry"

    def _fetch_from_disk(self, tokens: list[int], floor: int) -> tuple[list[Any], list[int]] | None:
        """Serve ``tokens`` from the disk tier when it covers more than ``floor`` tokens.
        None on a disk miss or an unreadable entry."""
        assert self.disk is not None
        while (found := self.disk.lookup(tokens, floor)) is not None:
            loaded = self._take_read(found[0])
            if loaded is None:
                loaded = self.disk.load(found[0])  # None: unreadable, and gone; try the next
            if loaded is not None:
                break
        else:
            self.disk.misses += 1
            return None
        # Not copied into RAM as well: the request's own state is stored when it ends.
        cache, entry_tokens, _ = loaded
        keep = found[1]
        if len(entry_tokens) > keep:
            trim_prompt_cache(cache, len(entry_tokens) - keep)
        self.hits += 1
        return cache, tokens[keep:]

    def prepare(self, tokens: list[int]) -> bool:
        """Whether ``fetch(tokens)`` can run now without reading a file. When the disk tier
        serves ``tokens`` best from a file, its read starts on the loader thread (once) and
        this says False until the file is in host memory."""
        if self.disk is None:
            return True
        key, keep = self._choose(self._trie.search(_KEY, tokens), tokens)
        if keep >= len(tokens) - 1:
            return True
        found = self.disk.lookup(tokens, keep if key is not None else 0)
        if found is None or self.disk.is_queued(found[0]):
            return True
        read = self._reads.get(found[0])
        if read is None:
            self._drop_stale_reads()
            if len(self._reads) >= _MAX_READS:
                return True  # no room to read ahead: fetch reads it (the old, blocking way)
            self._reads[found[0]] = (
                self.disk.read_async(found[0], self.on_loaded),
                time.monotonic(),
            )
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
        """The entry ``prepare`` read off the engine thread, as MLX arrays; None if none."""
        assert self.disk is not None
        future, _ = self._reads.pop(name, (None, 0.0))
        if future is None or not future.done() or (read := future.result()) is None:
            return None
        cache = self.disk.materialize(read)
        return (cache, read.tokens, read.kind) if cache is not None else None

    def cached_length(self, tokens: list[int]) -> int:
        """How many leading tokens ``fetch`` would serve from the cache (no copy, no hit
        counted)."""
        key, keep = self._choose(self._trie.search(_KEY, tokens), tokens)
        keep = keep if key is not None else 0
        if self.disk is not None and keep < len(tokens) - 1:
            found = self.disk.lookup(tokens, keep)
            keep = found[1] if found is not None else keep
        return keep

    def _choose(self, res: Any, tokens: list[int]) -> tuple[list[int] | None, int]:
        """Which entry to use and how many of its tokens to keep."""
        if res.exact is not None:
            entry = self._trie.get(_KEY, res.exact)
            if can_trim_prompt_cache(entry.prompt_cache):
                return res.exact, len(tokens) - 1
            # It cannot be rewound by one token to recompute the last logits: the longest
            # stored prefix (a checkpoint) serves instead.
            res = self._trie.search(_KEY, tokens[:-1])
            if res.exact is not None:
                return res.exact, len(res.exact)
        shorter = len(res.shorter) if res.shorter is not None else 0
        if res.longer is not None and res.common_prefix > shorter:
            entry = self._trie.get(_KEY, res.longer)
            if can_trim_prompt_cache(entry.prompt_cache):
                return res.longer, min(len(tokens) - 1, res.common_prefix)
        if shorter > 0:
            return res.shorter, shorter
        return None, 0

    def insert(self, tokens: list[int], prompt_cache: list[Any], kind: str = CONVERSATION) -> bool:
        """Store the KV state of ``tokens`` (the cache must hold exactly those tokens).
        Returns whether it was stored: a failure (of this entry or of an eviction it caused)
        is logged once and counted, and the entry dropped."""
        tokens = list(tokens)
        try:
            self.insert_cache(_KEY, tokens, prompt_cache, cache_type=kind)
            return True
        except Exception as e:
            self.faults.note("storing an entry", e)
            self._drop_broken(tokens)
            return False

    def _drop_broken(self, tokens: list[int]) -> None:
        """Take out the entry of ``tokens`` whose insert failed half way (if it got in)."""
        if self._trie.search(_KEY, tokens).exact is None:
            return
        self._lru.remove(_KEY, tokens)
        self._account(self._trie.pop(_KEY, tokens), -1)

    def insert_cache(
        self,
        model: Any,
        tokens: list[int],
        prompt_cache: list[Any],
        *,
        cache_type: str = CONVERSATION,
    ) -> None:
        if self._lru.kind_of(model, tokens) == SYSTEM:
            cache_type = SYSTEM  # keep a system prompt's priority when it is stored again
        entry = LRUPromptCache.CacheEntry(
            prompt_cache, sum(c.nbytes for c in prompt_cache), cache_type
        )
        if entry.nbytes > self.max_bytes:
            self._oversize(tokens, entry)
            return
        prev = self._trie.add(model, tokens, entry)
        if prev is not None:
            self._account(prev, -1)
            self._lru.remove(model, tokens)
        self._account(entry, +1)
        self._lru.push(model, tokens, cache_type)
        if self.on_change is not None:
            self.on_change("store", tokens, cache_type)
        if can_trim_prompt_cache(prompt_cache):
            self._drop_prefixes(model, tokens)
        self.missed.stored(tokens)
        if cache_type == SYSTEM:
            self._to_disk(tokens, prompt_cache, cache_type)  # the prefix that never changes
        self._enforce_limits()
        if self.on_insert is not None:
            self.on_insert()

    def _oversize(self, tokens: list[int], entry: Any) -> None:
        """An entry the RAM tier cannot hold even alone: to the disk tier, or dropped."""
        self.oversize += 1
        where = "kept on disk only" if self.disk is not None else "not kept (no disk tier)"
        log(
            f"Prompt cache: a {len(tokens)}-token state ({entry.nbytes >> 20}MB) is larger "
            f"than the RAM tier ({self.max_bytes >> 20}MB, --prompt-cache-gb): {where}"
        )
        self.missed.forget_later(tokens, "oversize", can_trim_prompt_cache(entry.prompt_cache))
        self._to_disk(tokens, entry.prompt_cache, entry.cache_type)

    def _to_disk(self, tokens: list[int], cache: list[Any], kind: str) -> bool:
        """Hand an entry to the disk tier (if any); a failure drops it there, logged once."""
        if self.disk is None:
            return False
        try:
            return self.disk.save(tokens, cache, kind)
        except Exception as e:
            self.faults.note("writing an entry to disk", e)
            return False

    def _drop_prefixes(self, model: Any, tokens: list[int]) -> None:
        """A trimmable entry also serves all its prefixes, so shorter ones only take space;
        system-prompt entries stay (they outlive the conversations built on them)."""
        for n, old in self._trie.pop_prefixes(model, tokens):
            if old.cache_type == SYSTEM:
                self._trie.add(model, tokens[:n], old)
                continue
            self._account(old, -1)
            self._lru.remove(model, tokens[:n])

    def _enforce_limits(self) -> None:
        # System entries may take at most half the slots, or many distinct system prompts
        # would leave no room for the conversations built on them.
        system = self._lru._lrus[SYSTEM]
        while len(system) > max(1, self.max_size // 2):
            self._evict(*system.popleft())
        while len(self._lru) > self.max_size or (self._n_bytes > self.max_bytes and len(self._lru)):
            self._evict(*self._lru.pop())

    def _evict(self, model: Any, tokens: list[int]) -> None:
        entry = self._trie.pop(model, tokens)
        self._account(entry, -1)
        self.evictions += 1
        if self.on_change is not None:
            self.on_change("evict", tokens, entry.cache_type)
        self.missed.forget_later(tokens, "evicted", can_trim_prompt_cache(entry.prompt_cache))
        self._to_disk(tokens, entry.prompt_cache, entry.cache_type)

    def forget(self, tokens: list[int]) -> None:
        """Drop the entry of exactly ``tokens`` (a no-op when there is none): replays an
        eviction another rank made."""
        if self._trie.search(_KEY, tokens).exact is None:
            return
        self._lru.remove(_KEY, tokens)
        self._evict(_KEY, tokens)

    def evict_bytes(self, n_bytes: int, keep_newest: bool = False) -> int:
        """Give back at least ``n_bytes`` of RAM (to the disk tier if there is one), least
        valuable entries first (all but the one stored last with ``keep_newest``). Returns
        the bytes freed."""
        before = self._n_bytes
        while len(self._lru) > int(keep_newest) and before - self._n_bytes < n_bytes:
            self._evict(*self._lru.pop())
        return before - self._n_bytes

    def close(self, timeout: float = 2.0) -> None:
        """Write the entries RAM still holds to the disk tier (most recently used first) and
        close it, waiting at most ``timeout`` seconds for the writes to finish."""
        if self.disk is None:
            return
        self.disk.mark_closing()  # a server restarted meanwhile waits for the folder
        deadline = time.monotonic() + timeout
        kinds = (SYSTEM, CHECKPOINT, CONVERSATION)
        for model, tokens in reversed([k for kind in kinds for k in self._lru._lrus[kind]]):
            if time.monotonic() >= deadline:
                break
            entry = self._trie.get(model, tokens)
            while not self._to_disk(tokens, entry.prompt_cache, entry.cache_type):
                if not self.disk.busy or time.monotonic() >= deadline:
                    break
                time.sleep(0.01)  # the writer queue is full: wait for a slot
        self.disk.close(max(0.0, deadline - time.monotonic()))

    def _account(self, entry: Any, sign: int) -> None:
        self._n_bytes += sign * entry.nbytes
        self._n_bytes_by_type[entry.cache_type] += sign * entry.nbytes

    def keys(self, kind: str | None = None) -> list[list[int]]:
        """The stored token sequences, least recently used first (of one kind, or all)."""
        kinds = [kind] if kind is not None else list(self._lru._lrus)
        return [list(t) for k in kinds for _, t in self._lru._lrus[k]]

    def stats(self) -> dict[str, Any]:
        """Counters for monitoring, and whether the disk tier is on (with why not)."""
        return {
            "prompt_cache_entries": len(self),
            "prompt_cache_system_entries": len(self._lru._lrus[SYSTEM]),
            "prompt_cache_bytes": self.nbytes,
            "prompt_cache_hits": self.hits,
            "prompt_cache_misses": self.misses,
            "prompt_cache_evictions": self.evictions,
            "prompt_cache_oversize": self.oversize,
            "prompt_cache_failures": self.faults.count,
            **self.missed.stats(),
            **(self.disk.stats() if self.disk is not None else {}),
            **self._disk_state(),
        }

    def _disk_state(self) -> dict[str, str]:
        if self.disk is not None:
            return {"prompt_cache_disk": "on", "prompt_cache_disk_dir": str(self.disk.directory)}
        state = {"prompt_cache_disk": "off"}
        if self.disk_off_reason:
            state["prompt_cache_disk_off_reason"] = self.disk_off_reason
        return state
