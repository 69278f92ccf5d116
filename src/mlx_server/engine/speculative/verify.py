"""Verify a draft in one forward pass of the target, and roll back what it rejects.

The target is fed the last emitted token followed by the ``k`` drafted ones; its logits at
each of those ``k + 1`` positions say what it would have produced there. Position ``i`` is
decided exactly as plain decoding would decide it (logits processors, then the request's
sampler) and compared with draft token ``i``: a match is accepted and the next position
decided; the first mismatch is emitted as the target's own token and ends the step. If every
draft token is accepted, the last position gives one more token.

Why this is exact: every emitted token is the sampler's choice on the target's
log-probabilities for the accepted context, so greedy output is that of plain decoding,
and a sampled token has the target's distribution whatever was drafted (for a draft
without a distribution of its own, as here, this is rejection sampling: the draft token is
accepted with probability ``p(d)`` and otherwise a token is drawn from ``p`` without it).
The sampler and the processors are called once per emitted token, in order, and never for
a position after a rejection: a seeded sampler's key sequence and a grammar's state advance
exactly as without speculation, so nothing has to be rolled back but the cache, which
``rollback.Rollback`` does on every kind of layer (trimmed, or restored and fed again).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlx_server.engine.sampling.samplers import SharedSampler
from mlx_server.engine.speculative.plan_log import PhaseClock
from mlx_server.engine.speculative.rejection import Rejection, speculative_sample
from mlx_server.engine.speculative.rollback import Rollback

Processor = Callable[[mx.array, mx.array], mx.array]
PAD_TOKEN = 0  # fed after a short draft to fill its pass; its logits are never read


@dataclass
class Verified:
    tokens: list[int]  # emitted: the accepted draft tokens, then the target's own token
    logprobs: list[mx.array]  # the target's log-probabilities for each emitted token (vocab,)
    accepted: int  # how many drafted tokens were accepted
    # What was fed (``last`` and the draft); the cache holds ``1 + accepted`` of it, and
    # ``rollback.keep`` takes it back further (a sequence that ends on an accepted token).
    rollback: Rollback | None = field(default=None, repr=False)


def verify(
    model: Any,
    cache: Any,
    last: int,
    draft: list[int],
    *,
    sampler: Callable[[mx.array], mx.array] | None,
    processors: Sequence[Processor] = (),
    history: list[int] | None = None,
    pad: int = 0,
    timings: dict[str, float] | None = None,
) -> Verified:
    """Feed ``last`` and ``draft`` after ``cache``, decide the emitted tokens, and trim the
    cache so it holds ``last`` and the accepted draft tokens (not the final emitted one).

    ``sampler`` None means greedy. ``history`` (the context before ``last``) is what the
    processors see, as in mlx-lm: the tokens so far, ending with the one just fed.
    ``pad``: positions fed after the draft and never used (the pass's shape; see
    ``costs``): attention is causal, so they change no position before them.
    ``timings``: where given, each phase's seconds (``plan_log.PhaseClock``).
    """
    clock = PhaseClock(timings)
    rollback = Rollback(model, cache)
    logits = _feed(rollback, last, draft, pad)
    clock.done("forward", logits)
    if sampler is None and not processors:
        out = _greedy(logits, draft)
    elif isinstance(sampler, SharedSampler) and not processors:
        out = _all_at_once(logits, draft, sampler)
    else:
        context = [*(history or []), last]
        out = _sequential(logits, draft, sampler, processors, context)
    clock.done("decide")
    kept = _kept(out, rollback)
    clock.done("roll back", [c.state for c in cache])
    return kept


def queue_pass(
    model: Any,
    cache: Any,
    first: mx.array,
    value: int,
    draft: list[int],
    width: int,
    sampler: Callable[[mx.array], mx.array] | None,
) -> tuple[Rollback, mx.array, mx.array]:
    """A pass queued on the device and not read (``sequence.SpeculativeSequence``'s
    pipelined passes; the warm-up runs it too, ``warm``): it feeds ``first`` (an array,
    possibly not computed yet: the choice of a pass before it; ``value`` stands for it in
    the rollback's ``fed``, -1 while unread) and ``draft`` padded to ``width``; returns the
    rollback, the log-probabilities at ``first`` and each draft token, and the choice at
    each (``sampler``, None: greedy), in the pass's own graph."""
    padded = [*draft, *[PAD_TOKEN] * (width - len(draft))]
    rollback = Rollback(model, cache)
    tokens = mx.concatenate([first.astype(mx.int32), mx.array(padded, dtype=mx.int32)])
    logprobs = _logprobs(rollback.feed_array(tokens, [value, *padded])[: len(draft) + 1])
    choice = mx.argmax(logprobs, axis=-1) if sampler is None else sampler(logprobs)
    mx.async_eval(choice, logprobs)
    return rollback, logprobs, choice


def _feed(rollback: Rollback, last: int, draft: list[int], pad: int) -> mx.array:
    """The logits at ``last`` and each draft token, from one pass padded by ``pad``."""
    logits = rollback.feed([last, *draft, *[PAD_TOKEN] * pad])
    return logits[: len(draft) + 1] if pad else logits


def _kept(out: Verified, rollback: Rollback) -> Verified:
    rollback.keep(1 + out.accepted)
    out.rollback = rollback
    return out


def _logprobs(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _greedy(logits: mx.array, draft: list[int]) -> Verified:
    logprobs = _logprobs(logits)
    choice: list[int] = mx.argmax(logprobs, axis=-1).tolist()  # type: ignore[assignment]
    n = 0
    while n < len(draft) and choice[n] == draft[n]:
        n += 1
    return Verified(choice[: n + 1], [logprobs[i] for i in range(n + 1)], n)


def _all_at_once(logits: mx.array, draft: list[int], sampler: SharedSampler) -> Verified:
    """A sampler without state of its own (``ignore_eos``'s ban, an unseeded temperature)
    decides every position in one call and one read, as the batch's rows sharing it do:
    each position's choice is independent, so the first mismatch is distributed as plain
    decoding's token there (``_sequential`` would read the device once per position)."""
    logprobs = _logprobs(logits)
    choice: list[int] = sampler(logprobs).tolist()  # type: ignore[assignment]
    n = 0
    while n < len(draft) and choice[n] == draft[n]:
        n += 1
    return Verified(choice[: n + 1], [logprobs[i] for i in range(n + 1)], n)


def _sequential(
    logits: mx.array,
    draft: list[int],
    sampler: Callable[[mx.array], mx.array] | None,
    processors: Sequence[Processor],
    context: list[int],
) -> Verified:
    tokens: list[int] = []
    lps: list[mx.array] = []
    for i in range(len(draft) + 1):
        row = logits[i : i + 1]
        if processors:
            seen = mx.array(context + tokens)
            for p in processors:
                row = p(seen, row)
        lp = _logprobs(row)
        choice = sampler(lp) if sampler is not None else mx.argmax(lp, axis=-1)
        tok = int(choice.item())  # type: ignore[arg-type]
        tokens.append(tok)
        lps.append(lp[0])
        if i == len(draft) or tok != draft[i]:
            break
    return Verified(tokens, lps, len(tokens) - 1)


def verify_sampled(
    model: Any,
    cache: Any,
    last: int,
    draft: list[int],
    q: mx.array,
    rejection: Rejection,
    pad: int = 0,
) -> Verified:
    """``verify`` for a draft sampled from the draft model's distribution ``q`` (k, vocab):
    rejection sampling against the target's (``rejection.speculative_sample``)."""
    rollback = Rollback(model, cache)
    logits = _feed(rollback, last, draft, pad)
    logprobs = _logprobs(logits)
    tokens = speculative_sample(rejection.distribution(logprobs), draft, q, rejection.draws)
    out = Verified(tokens, [logprobs[i] for i in range(len(tokens))], len(tokens) - 1)
    return _kept(out, rollback)
