"""The prefix cache's rules: the kinds of entry and the order they are evicted in, and which
stored entry serves a prompt (``choose``)."""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache

KEY = "model"  # one model per engine: a constant trie namespace
SYSTEM = "system"
CONVERSATION = "assistant"
# The state at a prompt's end, before generation, for caches that cannot be trimmed: evicted
# after the finished conversations' states (which serve a next turn only when it repeats the
# answer token for token), before system prompts.
CHECKPOINT = "user"


class SystemLast(LRUPromptCache.CacheOrder):
    """Eviction order: oldest conversation entry first, system-prompt entries last."""

    def pop(self) -> tuple[Any, list[int]]:
        for kind in (CONVERSATION, CHECKPOINT, SYSTEM):
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


def choose(trie: Any, res: Any, tokens: list[int]) -> tuple[list[int] | None, int]:
    """Which entry of ``trie`` to use for ``tokens`` (``res``: the trie's search result) and
    how many of its tokens to keep; the last prompt token is always left to compute."""
    if res.exact is not None:
        entry = trie.get(KEY, res.exact)
        if can_trim_prompt_cache(entry.prompt_cache):
            return res.exact, len(tokens) - 1
        # It cannot be rewound by one token to recompute the last logits: the longest
        # stored prefix (a checkpoint) serves instead.
        res = trie.search(KEY, tokens[:-1])
        if res.exact is not None:
            return res.exact, len(res.exact)
    shorter = len(res.shorter) if res.shorter is not None else 0
    if res.longer is not None and res.common_prefix > shorter:
        entry = trie.get(KEY, res.longer)
        if can_trim_prompt_cache(entry.prompt_cache):
            return res.longer, min(len(tokens) - 1, res.common_prefix)
    if shorter > 0:
        return res.shorter, shorter
    return None, 0
