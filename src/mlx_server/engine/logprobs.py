"""Log-probability entries for generated tokens (the chosen token and the top alternatives)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_server.events import LogprobEntry, TokenLogprob


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
        top = tuple(
            _alternative(tokenizer, int(i), float(v)) for i, v in zip(ids, lps, strict=True)
        )
    chosen: Any = logprobs[token].item()
    return LogprobEntry(text, float(chosen), list(text.encode()), top)


def _alternative(tokenizer: Any, token: int, logprob: float) -> TokenLogprob:
    s = tokenizer.decode([token])
    return TokenLogprob(s, logprob, list(s.encode()))
