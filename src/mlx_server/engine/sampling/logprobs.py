"""Log-probability entries for generated tokens (the chosen token and the top alternatives)."""

from __future__ import annotations

import math
import weakref
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


@dataclass(frozen=True)
class PickedValues:
    """``Picked``'s figures already read (a batch's, ``BatchPicks.read``)."""

    chosen: float
    top: tuple[tuple[int, float], ...]  # at most k (id, log-probability), most likely first


# The most alternatives a batch computes for every row in its step (the APIs allow 20).
BATCH_TOP = 20


@dataclass(frozen=True)
class BatchPicks:
    """A batch step's log-probability figures, made in the step's graph for every row (shapes
    that depend on the batch size only: where kernels are built per shape, the rows that ask
    for them change nothing), and read once the step is done, for the rows (by key) that
    asked: ``wants`` maps a row's key to its number of alternatives."""

    keys: list[int]  # each row's key (the batch's uids), in the batch's order
    wants: dict[int, int]
    chosen: mx.array  # (rows,)
    top_ids: mx.array | None  # (rows, BATCH_TOP), most likely first; None: no row asks any
    top_vals: mx.array | None

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.chosen, self.top_ids, self.top_vals) if a is not None]

    def read(self) -> dict[int, PickedValues]:
        """Each asking row's figures (one read per array, the step being done)."""
        chosen: list[Any] = self.chosen.tolist()  # type: ignore[assignment]
        ids: list[Any] = self.top_ids.tolist() if self.top_ids is not None else []  # type: ignore[assignment]
        vals: list[Any] = self.top_vals.tolist() if self.top_vals is not None else []  # type: ignore[assignment]
        out = {}
        for e, key in enumerate(self.keys):
            k = self.wants.get(key)
            if k is None:
                continue
            top = tuple(zip(ids[e][:k], vals[e][:k], strict=True)) if k > 0 else ()
            out[key] = PickedValues(float(chosen[e]), top)
        return out


def batch_picks(
    logprobs: mx.array, tokens: mx.array, keys: list[int], wants: dict[int, int]
) -> BatchPicks | None:
    """``BatchPicks`` for a step's log-probabilities (rows × vocabulary) and its sampled
    tokens, when a row of ``keys`` is in ``wants`` (None otherwise); lazy, for the step to
    evaluate."""
    mine = {key: wants[key] for key in keys if key in wants}
    if not mine:
        return None
    chosen = mx.take_along_axis(logprobs, tokens.reshape(-1, 1), axis=-1).reshape(-1)
    if max(mine.values()) <= 0:
        return BatchPicks(list(keys), mine, chosen, None, None)
    idx, vals = _top(logprobs, min(BATCH_TOP, logprobs.shape[-1]))
    return BatchPicks(list(keys), mine, chosen, idx, vals)


def pick(logprobs: mx.array, token: mx.array, k: int) -> Picked:
    """``Picked`` for one row of log-probabilities (vocabulary wide) and its sampled token
    (shape (1,)), with the ``k`` likeliest alternatives; lazy, for the step to evaluate."""
    chosen = mx.take(logprobs, token.reshape(-1)[:1])
    if k <= 0:
        return Picked(chosen, None, None)
    idx, vals = _top(logprobs, k)
    return Picked(chosen, idx, vals)


def _top(logprobs: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The ``k`` likeliest ids and their log-probabilities along the last axis (a row, or
    a batch's rows), most likely first."""
    idx = mx.argpartition(-logprobs, k - 1, axis=-1)[..., :k]
    vals = mx.take_along_axis(logprobs, idx, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return mx.take_along_axis(idx, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)


def logprob_entry(
    tokenizer: Any,
    token: int,
    logprobs: mx.array,
    k: int,
    picked: Picked | PickedValues | None = None,
) -> LogprobEntry:
    """The chosen token's log-probability and, when ``k > 0``, the ``k`` most likely tokens
    in descending order, from one step's log-probabilities over the vocabulary (or from
    ``picked``, the same figures made in the step's graph)."""
    text, raw = token_text(tokenizer, token)
    pairs: Any = ()  # (id, log-probability) of the alternatives, most likely first
    if isinstance(picked, PickedValues):
        chosen, pairs = picked.chosen, picked.top[:k]
    else:
        if k > 0:
            if picked is not None and picked.top_ids is not None and picked.top_vals is not None:
                top_ids, top_vals = picked.top_ids, picked.top_vals
            else:
                top_ids, top_vals = _top(logprobs, k)
            pairs = zip(top_ids.tolist(), top_vals.tolist(), strict=True)  # type: ignore[arg-type]
        value = picked.chosen if picked is not None else logprobs[token]
        chosen = float(value.item())  # type: ignore[arg-type]
    # Tokens a constraint masked out have probability 0 (-inf): they are no alternatives,
    # and -inf is not JSON. The list may then be shorter than asked.
    top = tuple(
        _alternative(tokenizer, int(i), float(v)) for i, v in pairs if math.isfinite(float(v))
    )
    chosen = max(chosen, LOGPROB_FLOOR) if math.isfinite(chosen) else LOGPROB_FLOOR
    return LogprobEntry(text, chosen, list(raw), top)


def _alternative(tokenizer: Any, token: int, logprob: float) -> TokenLogprob:
    text, raw = token_text(tokenizer, token)
    return TokenLogprob(text, logprob, list(raw))


# Each tokenizer's single-token texts, as decoded (a batch of 32 rows asking for 5
# alternatives decodes 192 tokens a step, most of them seen before).
_TEXTS: weakref.WeakKeyDictionary[Any, dict[int, tuple[str, bytes]]] = weakref.WeakKeyDictionary()
MAX_TEXTS = 1 << 17  # tokens kept per tokenizer (a vocabulary's worth; then it starts over)


def token_text(tokenizer: Any, token: int) -> tuple[str, bytes]:
    """``tokenizer.decode([token])`` and its UTF-8 bytes, remembered per tokenizer."""
    try:
        texts = _TEXTS.get(tokenizer)
        if texts is None:
            texts = _TEXTS[tokenizer] = {}
    except TypeError:  # a tokenizer that cannot be weakly referenced: decode each time
        text = tokenizer.decode([token])
        return text, text.encode()
    hit = texts.get(token)
    if hit is None:
        if len(texts) >= MAX_TEXTS:
            texts.clear()
        text = tokenizer.decode([token])
        hit = texts[token] = (text, text.encode())
    return hit
