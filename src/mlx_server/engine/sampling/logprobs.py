"""Log-probability entries for generated tokens (the chosen token and the top alternatives)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_server.events import LogprobEntry, TokenLogprob

# The chosen token's log-probability is finite in practice (it was sampled); should a
# processor have masked it anyway, or the model's logits hold NaN, it is reported as this
# floor: -inf and NaN are not JSON (the response would be a 500).
LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class Picked:
    """One step's figures for a row's log-probabilities, as arrays of the step's own graph
    (``pick``): evaluated with the step, they are read without waiting for the next one. Read
    after it (as a vocabulary row), each read queues behind the step already launched, and
    the lone path's pipeline stalls once per token (on the H100's 1B, a request with
    ``top_logprobs`` 5 decoded at 378 tok/s against greedy's 500)."""

    chosen: mx.array  # the sampled token's log-probability, shape (1,)
    top_ids: mx.array | None  # the k likeliest tokens, most likely first (None: k = 0)
    top_vals: mx.array | None

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.chosen, self.top_ids, self.top_vals) if a is not None]


def pick(logprobs: mx.array, token: mx.array, k: int) -> Picked:
    """``Picked`` for one row of log-probabilities (vocabulary wide) and its sampled token
    (shape (1,)), with the ``k`` likeliest alternatives; lazy, for the step to evaluate."""
    chosen = mx.take(logprobs, token.reshape(-1)[:1])
    if k <= 0:
        return Picked(chosen, None, None)
    idx, vals = _top(logprobs, k)
    return Picked(chosen, idx, vals)


def _top(logprobs: mx.array, k: int) -> tuple[mx.array, mx.array]:
    idx = mx.argpartition(-logprobs, k - 1)[:k]
    vals = logprobs[idx]
    order = mx.argsort(-vals)
    return idx[order], vals[order]


def logprob_entry(
    tokenizer: Any, token: int, logprobs: mx.array, k: int, picked: Picked | None = None
) -> LogprobEntry:
    """The chosen token's log-probability and, when ``k > 0``, the ``k`` most likely tokens
    in descending order, from one step's log-probabilities over the vocabulary (or from
    ``picked``, the same figures made in the step's graph)."""
    text = tokenizer.decode([token])
    top: tuple[TokenLogprob, ...] = ()
    if k > 0:
        if picked is not None and picked.top_ids is not None and picked.top_vals is not None:
            top_ids, top_vals = picked.top_ids, picked.top_vals
        else:
            top_ids, top_vals = _top(logprobs, k)
        ids: list[Any] = top_ids.tolist()  # type: ignore[assignment]
        lps: list[Any] = top_vals.tolist()  # type: ignore[assignment]
        # Tokens a constraint masked out have probability 0 (-inf): they are no
        # alternatives, and -inf is not JSON. The list may then be shorter than asked.
        top = tuple(
            _alternative(tokenizer, int(i), float(v))
            for i, v in zip(ids, lps, strict=True)
            if math.isfinite(v)
        )
    value = picked.chosen if picked is not None else logprobs[token]
    chosen = float(value.item())  # type: ignore[arg-type]
    chosen = max(chosen, LOGPROB_FLOOR) if math.isfinite(chosen) else LOGPROB_FLOOR
    return LogprobEntry(text, chosen, list(text.encode()), top)


def _alternative(tokenizer: Any, token: int, logprob: float) -> TokenLogprob:
    s = tokenizer.decode([token])
    return TokenLogprob(s, logprob, list(s.encode()))
