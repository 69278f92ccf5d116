"""Which models need checkpoints: prompt-end states kept for caches that cannot be rewound.

A plain KV cache serves any prefix of what it holds (it is trimmed back), so the state a
finished sequence leaves serves the next turn of its conversation. A recurrent layer
(``ArraysCache``: Mamba, gated-delta, short convolutions) holds one state for all the
tokens it has seen, and a sliding-window layer (``RotatingKVCache``) past its window has
overwritten the oldest ones: neither goes back. For those, the engine keeps the state at the
end of each prompt's prefill, before generation (the prompt less its last token, which the
first decode step feeds): an exact repeat and any extension of the prompt (the next turn,
even when the template drops the previous answer's reasoning) resume from it.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import CacheList, RotatingKVCache, make_prompt_cache


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
