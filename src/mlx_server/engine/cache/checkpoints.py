"""Checkpoints: states kept inside a prompt for caches that cannot be rewound.

A plain KV cache serves any prefix of what it holds (it is trimmed back), so the state a
finished sequence leaves serves the next turn of its conversation. A recurrent layer
(``ArraysCache``: Mamba, gated-delta, short convolutions) holds one state for all the
tokens it has seen, and a sliding-window layer (``RotatingKVCache``) past its window has
overwritten the oldest ones: neither goes back. For those, the prefill pauses where a later
request is likely to diverge, and the engine keeps the state there (a ``CHECKPOINT`` entry):

- the prompt's end, before generation (the prompt less its last token, which the first
  decode step feeds): an exact repeat, and the next turn where the template's generation
  prompt is what the history repeats (ChatML's ``<|im_start|>assistant\n``);
- the end of the conversation history, before the generation prompt, where the next turn
  does not repeat the generation prompt (one that opens ``<think>``, as Nemotron-H's does;
  the chat service finds it, ``service/history.py``);
- chunk boundaries of a long prefill (every ``every`` tokens, at most ``MAX_CHUNKS`` of them
  per request, spread out, the last kept): a long shared prefix the system-prompt entry does
  not cover serves a request whose later text differs.

Each checkpoint is a full copy of the state up to it, so a request keeps at most
``MAX_CHUNKS + 2`` (and its system-prompt entry); they are evicted like any entry, before
system prompts and after finished conversations (``prefix.CHECKPOINT``).
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import CacheList, RotatingKVCache, make_prompt_cache

MAX_CHUNKS = 2  # chunk-boundary checkpoints per request
CHUNK_EVERY = 4096  # tokens between chunk boundaries


def pauses(
    prompt_len: int, cached: int, *, history_end: int = 0, every: int = CHUNK_EVERY
) -> tuple[int, ...]:
    """Prompt offsets, past the ``cached`` ones, where the prefill pauses for a checkpoint:
    the history's end and the chosen chunk boundaries (the prompt's end, ``prompt_len - 1``,
    ends a segment anyway)."""
    last = prompt_len - 1
    points = {history_end} if cached < history_end < last else set()
    if every > 0:
        first = (cached // every + 1) * every
        bounds = list(range(first, last, every))
        n = len(bounds)
        if n > MAX_CHUNKS:  # spread over the prefill, the one nearest the end kept
            bounds = [bounds[(i + 1) * n // MAX_CHUNKS - 1] for i in range(MAX_CHUNKS)]
        points.update(bounds)
    return tuple(sorted(points))


def needs_checkpoints(model: Any) -> bool:
    """Whether some layer of the model's cache can come to a point it cannot be trimmed
    back from."""
    try:
        cache = make_prompt_cache(model)
    except Exception:  # a model without a usual cache: no checkpoints, nothing breaks
        return False
    return any(_one_way(c) for c in cache)


def _one_way(c: Any) -> bool:
    if isinstance(c, CacheList):
        return any(_one_way(sub) for sub in c.caches)
    return isinstance(c, RotatingKVCache) or not c.is_trimmable()
