"""Why a prompt missed the prefix cache: one reason per miss, logged and counted.

The reasons (``REASONS``):

- ``no_entry``: nothing stored shares a usable prefix with the prompt;
- ``not_trimmable``: an entry longer than the shared prefix exists, but its cache cannot
  be rewound to it (recurrent state, a sliding window past its size);
- ``evicted``: an entry that would have served was evicted (and the disk tier, if any, did
  not keep it);
- ``oversize``: an entry that would have served was larger than the tier and never kept;
- ``different_model``: an entry that would have served belongs to another model, or to
  this one under another configuration or cache format (the disk tier keeps those apart);
- ``failed``: reading the entry failed (logged by ``cache_faults``);
- ``short_prefix``: where kernels are built per shape (CUDA), a prefix of at most
  ``PrefixCache.short_hit`` tokens before a longer rest (a chat template's opening before a
  new conversation's prompt) is not used: a long chunk after it meets a cuDNN graph for its
  key length (about 36 ms on an H100, where the 1B's whole 1,157-token prefill takes 12),
  from an empty cache the bucket's own graph, warmed in idle time.

Entries that are gone are remembered by their tokens only (no state), a bounded number of
them, in a token trie searched like the cache itself.
"""

from __future__ import annotations

import base64
import json
from collections import deque
from pathlib import Path

import numpy as np

from mlx_server.engine.cache.trie import TokenTrie
from mlx_server.logs import log

REASONS = (
    "no_entry",
    "not_trimmable",
    "evicted",
    "oversize",
    "different_model",
    "failed",
    "short_prefix",
)
_KEY = "gone"
_MAX_GONE = 1024  # token sequences remembered
_MAX_FOREIGN = 256  # entries read from other models' manifests at start
_WORTH = 64  # shared tokens that make an entry one that would have served (``worth``)


def worth(shared: int, tokens: list[int]) -> bool:
    """Whether a prefix of ``shared`` tokens, cut out of a longer entry, would have been worth
    serving: more than a chat template's opening (which every prompt shares with every
    other), so that a miss of an unrelated prompt is told as ``no_entry``."""
    return shared >= min(_WORTH, len(tokens) // 2)


class MissLog:
    """Counts misses by reason and remembers which entries are gone and why."""

    def __init__(self) -> None:
        self.counts = dict.fromkeys(REASONS, 0)
        self._gone = TokenTrie()
        self._order: deque[list[int]] = deque()

    def forget_later(self, tokens: list[int], reason: str, trimmable: bool) -> None:
        """Remember that the entry of ``tokens`` is gone for ``reason``."""
        if len(self._order) >= _MAX_GONE:
            old = self._order.popleft()
            if self._gone.search(_KEY, old).exact is not None:
                self._gone.pop(_KEY, old)
        tokens = list(tokens)
        if self._gone.add(_KEY, tokens, (reason, trimmable)) is None:
            self._order.append(tokens)

    def stored(self, tokens: list[int]) -> None:
        """An entry of ``tokens`` is stored again: it is no longer gone."""
        if self._order and self._gone.search(_KEY, tokens).exact is not None:
            self._gone.pop(_KEY, tokens)
            self._order.remove(list(tokens))

    def gone_reason(self, tokens: list[int]) -> str | None:
        """Why the best entry for ``tokens`` is gone, if one that would have served is."""
        if not self._order:
            return None
        res = self._gone.search(_KEY, tokens)
        if res.exact is not None:
            return str(self._gone.get(_KEY, res.exact)[0])
        if res.longer is not None and worth(res.common_prefix, tokens):
            reason, trimmable = self._gone.get(_KEY, res.longer)
            if trimmable:
                return str(reason)
        if res.shorter is not None:
            return str(self._gone.get(_KEY, res.shorter)[0])
        return None

    def miss(self, reason: str, n_tokens: int) -> None:
        """Count a miss and log it (one line per request that missed)."""
        self.counts[reason] += 1
        log(f"Prompt cache: miss for a {n_tokens}-token prompt: {reason.replace('_', ' ')}")

    def stats(self) -> dict[str, int]:
        return {f"prompt_cache_miss_{r}": n for r, n in self.counts.items()}

    def load_foreign(self, directory: Path) -> None:
        """Remember the entries of the same model's other disk folders (another version of
        its files, another KV layout or cache format) as gone to a different model."""
        stem = directory.name.rsplit("-", 1)[0]
        n = 0
        for other in sorted(directory.parent.glob(f"{stem}-*")):
            if other == directory or n >= _MAX_FOREIGN:
                continue
            for tokens in _manifest_tokens(other / "index.json"):
                self.forget_later(tokens, "different_model", True)
                n += 1
                if n >= _MAX_FOREIGN:
                    break


def _manifest_tokens(path: Path) -> list[list[int]]:
    """The token sequences a disk folder's manifest lists (any format); [] if unreadable."""
    try:
        entries = json.loads(path.read_text()).get("entries", {})
        return [
            np.frombuffer(base64.b64decode(e["tokens"]), dtype="<i4").tolist()
            for e in entries.values()
        ]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
