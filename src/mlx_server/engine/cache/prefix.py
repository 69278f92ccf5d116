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

With a disk tier (``disk.DiskPromptCache``; this cache's side of it is ``prefix_disk``),
entries that leave RAM and system-prompt entries are also written to disk, and a lookup the
disk serves better than RAM loads the entry from there (read ahead by ``prepare``). The
rules (kinds of entry, eviction order, which entry serves a prompt) are ``prefix_rules``.

An entry larger than the whole RAM tier cannot stay in it: it goes to the disk tier (or,
without one, is dropped), and either way it is logged and counted (``prompt_cache_oversize``).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from mlx_server.engine.cache.faults import CacheFaults
from mlx_server.engine.cache.misses import MissLog, worth
from mlx_server.engine.cache.prefix_disk import DiskSide
from mlx_server.engine.cache.prefix_rules import (
    CHECKPOINT,
    CONVERSATION,
    KEY,
    SYSTEM,
    SystemLast,
    choose,
)
from mlx_server.engine.cache.trie import TokenTrie
from mlx_server.logs import log

__all__ = ["CHECKPOINT", "CONVERSATION", "SYSTEM", "PrefixCache"]

if TYPE_CHECKING:
    from mlx_server.engine.cache.disk import DiskPromptCache


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
        # mlx-lm's interface (tests/engine/test_token_trie.py), a search that walks no subtree
        self._trie = TokenTrie()  # type: ignore[assignment]
        self._lru: SystemLast = SystemLast()
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
        # A hit of at most this many tokens before a rest longer than it is not used (set
        # where kernels are built per shape: ``misses`` ``short_prefix``); 0: every hit is.
        self.short_hit = 0
        self._disk = DiskSide(disk, self.faults) if disk is not None else None
        if disk is not None:
            self.missed.load_foreign(disk.directory)

    def fetch(self, tokens: list[int]) -> tuple[list[Any] | None, list[int]]:
        """A private copy of the KV state for the longest usable prefix of ``tokens`` and the
        tokens still to prefill (never empty); ``(None, tokens)`` on a miss, whose reason is
        logged and counted. An entry that fails to copy or load is dropped: a miss."""
        key: list[int] | None = None
        try:
            res = self._trie.search(KEY, tokens)
            key, keep = choose(self._trie, res, tokens)
            if self._disk is not None and keep < len(tokens) - 1:
                loaded = self._disk.fetch(tokens, keep if key is not None else 0)
                if loaded is not None:
                    self.hits += 1
                    return loaded
            if key is None or keep <= 0:
                self._miss(tokens, self._why_missed(res, tokens))
                return None, tokens
            if keep <= self.short_hit < len(tokens) - keep - 1:
                self._miss(tokens, "short_prefix")
                return None, tokens
            cache = copy.deepcopy(self._trie.get(KEY, key).prompt_cache)
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
        self._lru.touch(KEY, key)
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

    def prepare(self, tokens: list[int]) -> bool:
        """Whether ``fetch(tokens)`` can run now without reading a file. When the disk tier
        serves ``tokens`` best from a file, its read starts on the loader thread (once) and
        this says False until the file is in host memory."""
        if self._disk is None:
            return True
        key, keep = choose(self._trie, self._trie.search(KEY, tokens), tokens)
        if keep >= len(tokens) - 1:
            return True
        return self._disk.read_ahead(tokens, keep if key is not None else 0, self.on_loaded)

    def settle(self, everything: bool = False) -> None:
        """Before each step (``everything``: when the engine goes idle): the disk tier's
        saved states whose arrays are computed by now go to its writer."""
        if self._disk is not None:
            self._disk.settle(everything)

    @property
    def loading(self) -> bool:
        """Whether a disk read is in flight."""
        return self._disk is not None and self._disk.loading

    def cached_length(self, tokens: list[int]) -> int:
        """How many leading tokens ``fetch`` would serve from the cache (no copy, no hit
        counted)."""
        key, keep = choose(self._trie, self._trie.search(KEY, tokens), tokens)
        keep = keep if key is not None else 0
        if self._disk is not None and keep < len(tokens) - 1:
            keep = self._disk.covers(tokens, keep)
        return keep

    def insert(self, tokens: list[int], prompt_cache: list[Any], kind: str = CONVERSATION) -> bool:
        """Store the KV state of ``tokens`` (the cache must hold exactly those tokens).
        Returns whether it was stored: a failure (of this entry or of an eviction it caused)
        is logged once and counted, and the entry dropped."""
        tokens = list(tokens)
        try:
            self.insert_cache(KEY, tokens, prompt_cache, cache_type=kind)
            return True
        except Exception as e:
            self.faults.note("storing an entry", e)
            self._drop_broken(tokens)
            return False

    def _drop_broken(self, tokens: list[int]) -> None:
        """Take out the entry of ``tokens`` whose insert failed half way (if it got in)."""
        if self._trie.search(KEY, tokens).exact is None:
            return
        self._lru.remove(KEY, tokens)
        self._account(self._trie.pop(KEY, tokens), -1)

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
        """Hand an entry to the disk tier (if any)."""
        return self._disk is not None and self._disk.save(tokens, cache, kind)

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
        if self._trie.search(KEY, tokens).exact is None:
            return
        self._lru.remove(KEY, tokens)
        self._evict(KEY, tokens)

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
        if self._disk is None:
            return
        kinds = (SYSTEM, CHECKPOINT, CONVERSATION)
        held = [k for kind in kinds for k in self._lru._lrus[kind]]
        self._disk.close(
            lambda: ((tokens, self._trie.get(model, tokens)) for model, tokens in reversed(held)),
            timeout,
        )

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
