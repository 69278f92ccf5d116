"""Verify several sequences' drafts in one batched forward pass, and roll back per row.

The batch is mlx-lm's ``GenerationBatch``: between steps each row's KV cache holds
``tokens[i]`` and ``_next_tokens[i]`` is the token sampled last, not yet fed nor answered.
A verifying step feeds every row its pending token ``n_i`` followed by its draft ``d_i``
(length ``k_i``, right-padded to the longest, ``K``; a row without a draft is padded from
its one token). Each row's positions are decided as plain decoding decides them
(``decide``): the pending token is answered, then each accepted draft token; the target's
own choice at the first rejection (or after a fully accepted draft) becomes the row's new
pending token, so the invariant holds after the step as before it.

Rollback: ``BatchKVCache`` has one write index for all rows, right-aligned, with left
padding masked. After the pass row ``i`` holds ``K - a_i`` positions it rejected (or
padded) at its end. The cache is trimmed by the fewest of them; a row with more rolls its
content right by the difference, which turns its rejected tail into left padding (the
cache's own ``prepare(right_padding=...)`` and ``finalize``, which its prefill uses for
right-padded prompts). Positions stay right: each row's RoPE offset counts its own tokens.

Other layers (a recurrent ``ArraysCache``, a sliding-window ``BatchRotatingKVCache``, the
quantized batch cache) are saved before the pass (``rollback``); after it they are
restored, the plain KV layers trimmed by the whole pass, and each row's kept tokens fed
again, right-padded, as mlx-lm's ``GenerationBatch.prompt`` feeds a batch's new tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, TokenBuffer

from mlx_server.engine.core.tuning import on_gpu
from mlx_server.engine.sampling.samplers import SharedSampler
from mlx_server.engine.speculative.plan_log import PhaseClock
from mlx_server.engine.speculative.rejection import Rejection, speculative_sample
from mlx_server.engine.speculative.rollback import (
    RollbackError,
    Saved,
    checked_trim,
    rollback_problem,
)

Sampled = tuple[mx.array, Rejection]  # a row's draft distribution (k, vocab), its settings
COMPACT_AT = 256  # padding every row shares, in positions, before the cache drops it


@dataclass
class Decided:
    """One row's verification: the accepted draft tokens, then the target's own token."""

    tokens: list[int]
    logprobs: list[mx.array]  # (vocab,) for each of ``tokens``

    @property
    def accepted(self) -> int:
        return len(self.tokens) - 1


def can_roll_back(cache: Sequence[Any]) -> bool:
    """Whether every layer's cache is one this module can roll back per row: trimmed and
    rolled (``BatchKVCache``), or saved, restored and fed again (any batched mlx-lm cache
    that takes right-padded tokens)."""
    if not cache or rollback_problem(list(cache)) is not None:
        return False
    return all(hasattr(c, "prepare") and hasattr(c, "finalize") for c in cache)


def _trims_per_row(cache: Sequence[Any]) -> bool:
    return all(type(c) is BatchKVCache for c in cache)


def verify_batch(
    batch: Any,
    pending: list[int],
    drafts: list[list[int]],
    sampled: dict[int, Sampled] | None = None,
    *,
    model: Any = None,
    processors: list[Sequence[Any]] | None = None,
    width: int = 0,
    timings: dict[str, float] | None = None,
) -> list[Any]:
    """One verifying step of ``batch`` (a ``GenerationBatch``): feed each row its pending
    token and draft, answer what was accepted, roll the rest back, and let finished rows
    go. Rows in ``sampled`` (by index) drafted from a draft model's distribution and are
    verified by rejection sampling. ``model``: the model to run (default the batch's: a
    wrapper there may expect one position per row); ``processors``: each row's logits
    processors (default its mlx-lm list); ``width``: the drafts' padded length, at least
    the longest (``costs.bucket``: the pass's shapes repeat); ``timings``: where given,
    each phase is evaluated on its own and its seconds put there (forward, decide, roll
    back: a benchmark's trace; the extra waits cost a little). Returns the step's
    ``GenerationBatch.Response`` list, several per row in order."""
    width = max(width, *(len(d) for d in drafts))
    rows = [[p, *d, *[0] * (width - len(d))] for p, d in zip(pending, drafts, strict=True)]
    cache = batch.prompt_cache
    per_row = _trims_per_row(cache)
    saved = None if per_row else [None if type(c) is BatchKVCache else Saved(c) for c in cache]
    clock = PhaseClock(timings)
    logits = (model or batch.model)(mx.array(rows), cache=cache)
    clock.done("forward", logits)
    procs = processors or [tuple(p or ()) for p in batch.logits_processors]
    decided = decide(batch, logits, pending, drafts, sampled or {}, procs)
    clock.done("decide")
    if saved is None:
        roll_back(cache, [width - d.accepted for d in decided])
    else:
        kept = [[p, *r[1 : 1 + d.accepted]] for p, r, d in zip(pending, rows, decided, strict=True)]
        feed_again(model or batch.model, cache, saved, width + 1, kept)
    clock.done("roll back", [c.state for c in cache])
    return _answer(batch, pending, decided)


def decide(
    batch: Any,
    logits: mx.array,
    pending: list[int],
    drafts: list[list[int]],
    sampled: dict[int, Sampled],
    processors: list[Sequence[Any]],
) -> list[Decided]:
    """Each row's emitted tokens, chosen as plain decoding would choose them: rows with
    logits processors or a sampler of their own (a seed) position by position, calling
    each once per emitted token in order; rows sharing a sampler in one call over all their
    positions (each position's draw is independent, so the first mismatch is distributed
    as plain decoding's token there); rows in ``sampled`` by rejection sampling."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    out: list[Decided | None] = [None] * len(drafts)
    groups: dict[int, list[int]] = {}
    for i in range(len(drafts)):
        sampler = _sampler(batch, i)
        if i in sampled and drafts[i]:
            q, rej = sampled[i]
            p = rej.distribution(logprobs[i, : len(drafts[i]) + 1])
            toks = speculative_sample(p, drafts[i], q[: len(drafts[i])], rej.draws)
            out[i] = Decided(toks, [logprobs[i, j] for j in range(len(toks))])
        elif processors[i] or not _shared(batch, sampler):
            out[i] = _one_by_one(batch, i, logits[i], pending[i], drafts[i], processors[i])
        else:
            groups.setdefault(id(sampler), []).append(i)
    for rows in groups.values():
        sampler = _sampler(batch, rows[0])
        lp = logprobs[mx.array(rows)]
        picked = sampler(lp.reshape(-1, lp.shape[-1])).reshape(len(rows), -1).tolist()
        for r, i in enumerate(rows):
            n = _agree(picked[r], drafts[i])
            out[i] = Decided(picked[r][: n + 1], [logprobs[i, j] for j in range(n + 1)])
    return [d for d in out if d is not None]


def _sampler(batch: Any, i: int) -> Any:
    s = batch.samplers[i] if batch.samplers else None
    return batch.fallback_sampler if s is None else s


def _shared(batch: Any, sampler: Any) -> bool:
    """A sampler that may draw for many rows at once: no state of its own to keep in step."""
    return isinstance(sampler, SharedSampler) or sampler is batch.fallback_sampler


def _agree(choices: list[int], draft: list[int]) -> int:
    n = 0
    while n < len(draft) and choices[n] == draft[n]:
        n += 1
    return n


def _one_by_one(
    batch: Any,
    i: int,
    logits: mx.array,
    pending: int,
    draft: list[int],
    processors: Sequence[Any],
) -> Decided:
    """Row ``i`` position by position: processors see the row's context ending with the
    position's input, as in ``GenerationBatch._step``."""
    context = [*batch.tokens[i], pending]
    sampler = _sampler(batch, i)
    tokens: list[int] = []
    lps: list[mx.array] = []
    for j in range(len(draft) + 1):
        row = logits[j : j + 1]
        if processors:
            seen = mx.array(context + tokens)
            for p in processors:
                row = p(seen, row)
        lp = row - mx.logsumexp(row, axis=-1, keepdims=True)
        tok = int(sampler(lp).item())
        tokens.append(tok)
        lps.append(lp[0])
        if j == len(draft) or tok != draft[j]:
            break
    return Decided(tokens, lps)


def roll_back(cache: Sequence[Any], rejected: list[int]) -> None:
    """Drop each row's last ``rejected[i]`` positions (see the module docstring)."""
    common = min(rejected)
    extra = [r - common for r in rejected]
    gather = on_gpu()
    for c in cache:
        checked_trim([c], common)
        if max(extra) > 0:
            if gather:  # one gather per buffer (the cache's own roll): few kernels
                c.prepare(right_padding=extra)
                c.finalize()
            else:
                rotate_rows(c, extra)
    _compact(cache)


def rotate_rows(c: BatchKVCache, extra: list[int]) -> None:
    """What ``prepare(right_padding=extra)`` and ``finalize()`` do to a ``BatchKVCache``, by
    copying slices: each row with ``extra[i] > 0`` has its held positions rotated right by
    it, so that its last ``extra[i]`` (rejected) come first and count as left padding. On a
    CPU a slice copy runs near memory speed where the roll's gather does not (2.2 to 4.5 x
    faster for a 135M model's buffers at batch 8); on a GPU the roll's one gather per buffer
    costs fewer kernel launches than a few slices per row, and stays."""
    end = c._idx
    for name in ("keys", "values"):
        x = getattr(c, name)
        rows = []
        for i, e in enumerate(extra):
            row = x[i : i + 1]
            if e:
                parts = [row[:, :, end - e : end], row[:, :, : end - e], row[:, :, end:]]
                row = mx.concatenate(parts, axis=2)
            rows.append(row)
        setattr(c, name, mx.concatenate(rows, axis=0))
    shift = mx.array(extra)
    c.offset = c.offset - shift
    c.left_padding = c.left_padding + shift


def feed_again(
    model: Any, cache: Sequence[Any], saved: list[Any], fed: int, kept: list[list[int]]
) -> None:
    """Put ``cache`` back to before a pass that fed ``fed`` positions per row, then feed
    each row its ``kept`` tokens (right-padded to the longest; see the module docstring)."""
    for layer, state in zip(cache, saved, strict=True):
        if state is not None:
            state.restore()
        else:
            checked_trim([layer], fed)
    lengths = [len(k) for k in kept]
    longest = max(lengths)
    padding = [longest - n for n in lengths]
    if max(padding) > 0:
        for c in cache:
            c.prepare(lengths=lengths, right_padding=padding)
    model(mx.array([k + [0] * (longest - len(k)) for k in kept]), cache=cache)
    if max(padding) > 0:
        for c in cache:
            c.finalize()


def _compact(cache: Sequence[Any]) -> None:
    """Drop the left padding every row has, once it is long (the cache's ``filter`` does
    this when rows leave)."""
    shared = int(mx.min(cache[0].left_padding).item())  # type: ignore[arg-type]
    if shared >= COMPACT_AT:
        keep = list(range(cache[0].left_padding.shape[0]))
        for c in cache:
            c.filter(keep)


def _answer(batch: Any, pending: list[int], decided: list[Decided]) -> list[Any]:
    """Answer each row's pending and accepted tokens, up to the first that ends it; set the
    new pending tokens; rows that ended leave the batch."""
    responses: list[Any] = []
    keep: list[int] = []
    old_logprobs = batch._next_logprobs
    for i, d in enumerate(decided):
        emitted = [pending[i], *d.tokens[:-1]]
        lps = [old_logprobs[i], *d.logprobs[:-1]]
        end, reason = _finish(batch, i, emitted)
        batch.tokens[i].extend(emitted[: end + 1])
        for j in range(end + 1):
            last = j == end and reason is not None
            cache = _finished_cache(batch, i, len(emitted) - 1 - end) if last else None
            responses.append(
                batch.Response(
                    uid=batch.uids[i],
                    token=emitted[j],
                    logprobs=lps[j],
                    finish_reason=reason if last else None,
                    prompt_cache=cache,
                    all_tokens=batch.tokens[i] if last else None,
                )
            )
        if reason is None:
            keep.append(i)
        if batch.logits_processors[i]:
            batch._token_context[i] = TokenBuffer(batch.tokens[i])
    batch._current_tokens = mx.array(pending, dtype=mx.uint32)
    batch._current_logprobs = list(old_logprobs)
    batch._next_tokens = mx.array([d.tokens[-1] for d in decided], dtype=mx.uint32)
    batch._next_logprobs = [d.logprobs[-1] for d in decided]
    if len(keep) < len(decided):
        batch.filter(keep)
    return responses


def _finish(batch: Any, i: int, emitted: list[int]) -> tuple[int, str | None]:
    """Where row ``i`` ends among ``emitted`` (its last index when it goes on), and why."""
    for j, tok in enumerate(emitted):
        batch._num_tokens[i] += 1
        reason = "length" if batch._num_tokens[i] >= batch.max_tokens[i] else None
        if batch._matchers[i].advance(tok):
            reason = "stop"
        if reason is not None:
            return j, reason
    return len(emitted) - 1, None


def _finished_cache(batch: Any, i: int, extra: int) -> list[Any] | None:
    """Row ``i``'s KV state for the prefix cache, without the ``extra`` accepted tokens
    after the one it ended on; None (nothing to keep) when those cannot be trimmed."""
    cache = list(batch.extract_cache(i))
    try:
        checked_trim(cache, extra)
    except RollbackError:
        return None
    return cache
