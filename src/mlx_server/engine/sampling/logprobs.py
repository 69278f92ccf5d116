"""Log-probability entries for generated tokens (the chosen token and the top alternatives)."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

from mlx_server.events import LogprobEntry, TokenLogprob

# The chosen token's log-probability is finite in practice (it was sampled); should a
# processor have masked it anyway, or the model's logits hold NaN, it is reported as this
# floor: -inf and NaN are not JSON (the response would be a 500).
LOGPROB_FLOOR = -9999.0


def logprob_entry(tokenizer: Any, token: int, logprobs: mx.array, k: int) -> LogprobEntry:
    """The chosen token's log-probability and, when ``k > 0``, the ``k`` most likely tokens
    in descending order, from one step's log-probabilities over the vocabulary."""
    text = tokenizer.decode([token])
    top: tuple[TokenLogprob, ...] = ()
    if k > 0:
        idx = mx.argpartition(-logprobs, k - 1)[:k]
        vals = logprobs[idx]
        order = mx.argsort(-vals)
        ids: list[Any] = idx[order].tolist()  # type: ignore[assignment]
        lps: list[Any] = vals[order].tolist()  # type: ignore[assignment]
        # Tokens a constraint masked out have probability 0 (-inf): they are no
        # alternatives, and -inf is not JSON. The list may then be shorter than asked.
        top = tuple(
            _alternative(tokenizer, int(i), float(v))
            for i, v in zip(ids, lps, strict=True)
            if math.isfinite(v)
        )
    chosen = float(logprobs[token].item())  # type: ignore[arg-type]
    chosen = max(chosen, LOGPROB_FLOOR) if math.isfinite(chosen) else LOGPROB_FLOOR
    return LogprobEntry(text, chosen, list(text.encode()), top)


def _alternative(tokenizer: Any, token: int, logprob: float) -> TokenLogprob:
    s = tokenizer.decode([token])
    return TokenLogprob(s, logprob, list(s.encode()))
