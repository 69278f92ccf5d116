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
"""

from __future__ import annotations

import copy
from typing import Any

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

_KEY = "model"  # one model per engine: a constant trie namespace
SYSTEM = "system"
CONVERSATION = "assistant"


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

    def __init__(self, max_entries: int, max_bytes: int):
        super().__init__(max_entries, max_bytes)
        self._lru: _SystemLast = _SystemLast()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def fetch(self, tokens: list[int]) -> tuple[list[Any] | None, list[int]]:
        """A private copy of the KV state for the longest usable prefix of ``tokens`` and the
        tokens still to prefill (never empty); ``(None, tokens)`` on a miss."""
        res = self._trie.search(_KEY, tokens)
        key, keep = self._choose(res, tokens)
        if key is None or keep <= 0:
            self.misses += 1
            return None, tokens
        cache = copy.deepcopy(self._trie.get(_KEY, key).prompt_cache)
        if len(key) > keep:
            trim_prompt_cache(cache, len(key) - keep)
        self._lru.touch(_KEY, key)
        self.hits += 1
        return cache, tokens[keep:]

    def cached_length(self, tokens: list[int]) -> int:
        """How many leading tokens ``fetch`` would serve from the cache (no copy, no hit
        counted)."""
        key, keep = self._choose(self._trie.search(_KEY, tokens), tokens)
        return keep if key is not None else 0

    def _choose(self, res: Any, tokens: list[int]) -> tuple[list[int] | None, int]:
        """Which entry to use and how many of its tokens to keep."""
        if res.exact is not None:
            entry = self._trie.get(_KEY, res.exact)
            if can_trim_prompt_cache(entry.prompt_cache):
                return res.exact, len(tokens) - 1
            return None, 0  # cannot rewind by one token to recompute the last logits
        shorter = len(res.shorter) if res.shorter is not None else 0
        if res.longer is not None and res.common_prefix > shorter:
            entry = self._trie.get(_KEY, res.longer)
            if can_trim_prompt_cache(entry.prompt_cache):
                return res.longer, min(len(tokens) - 1, res.common_prefix)
        if shorter > 0:
            return res.shorter, shorter
        return None, 0

    def insert(self, tokens: list[int], prompt_cache: list[Any], kind: str = CONVERSATION) -> None:
        """Store the KV state of ``tokens`` (the cache must hold exactly those tokens)."""
        self.insert_cache(_KEY, list(tokens), prompt_cache, cache_type=kind)

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
        prev = self._trie.add(model, tokens, entry)
        if prev is not None:
            self._account(prev, -1)
            self._lru.remove(model, tokens)
        self._account(entry, +1)
        self._lru.push(model, tokens, cache_type)
        if can_trim_prompt_cache(prompt_cache):
            self._drop_prefixes(model, tokens)
        self._enforce_limits()

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
        self._account(self._trie.pop(model, tokens), -1)
        self.evictions += 1

    def _account(self, entry: Any, sign: int) -> None:
        self._n_bytes += sign * entry.nbytes
        self._n_bytes_by_type[entry.cache_type] += sign * entry.nbytes

    def keys(self, kind: str | None = None) -> list[list[int]]:
        """The stored token sequences, least recently used first (of one kind, or all)."""
        kinds = [kind] if kind is not None else list(self._lru._lrus)
        return [list(t) for k in kinds for _, t in self._lru._lrus[k]]

    def stats(self) -> dict[str, int]:
        """Counters for monitoring."""
        return {
            "prompt_cache_entries": len(self),
            "prompt_cache_system_entries": len(self._lru._lrus[SYSTEM]),
            "prompt_cache_bytes": self.nbytes,
            "prompt_cache_hits": self.hits,
            "prompt_cache_misses": self.misses,
            "prompt_cache_evictions": self.evictions,
        }
