"""Drafters: each proposes the next few tokens of a sequence for the target to verify.

A drafter sees the whole context (prompt and accepted tokens, in order) on every call and
proposes at most ``k`` tokens; an empty proposal means "decode one token as usual". The
context only grows between calls, except that a sequence may be handed a drafter for a
context it has never seen (a new request), so drafters that keep state check it.
"""

from __future__ import annotations

from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_server.engine.speculative.rejection import Rejection
from mlx_server.engine.speculative.rollback import Rollback, RollbackError, checked_trim


class Drafter(Protocol):
    """Proposes tokens to follow ``context``; see the module docstring."""

    def propose(self, context: list[int], k: int) -> list[int]: ...


def propose_ahead(drafter: Drafter, context: list[int], k: int) -> list[int]:
    """A proposal after a context not confirmed yet (its tail is a draft still being
    verified: ``sequence.SpeculativeSequence`` queues the next pass behind the one it
    reads), leaving the drafter as it was, so that a rejected tail does not move it. A
    drafter without ``propose_ahead`` keeps no state that a context can move (a test's
    oracle, random drafts): its ``propose``."""
    ahead = getattr(drafter, "propose_ahead", None)
    return ahead(context, k) if ahead is not None else drafter.propose(context, k)


class NgramIndex:
    """The latest position at which each n-gram (``min_n`` to ``max_n`` tokens) of a growing
    token list ended, so a lookup costs a few dict reads however long the context is."""

    def __init__(self, min_n: int = 1, max_n: int = 3):
        self.min_n, self.max_n = min_n, max_n
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in the index

    def extend(self, tokens: list[int], upto: int) -> None:
        """Index the n-grams of ``tokens`` that end at positions ``< upto``."""
        for end in range(max(self._indexed, 1), upto):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._ends[tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, upto)

    def find(self, tail: list[int]) -> int | None:
        """Where the longest suffix of ``tail`` (``max_n`` down to ``min_n`` tokens) last
        ended in the indexed tokens, or None."""
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            end = self._ends.get(tuple(tail[-n:]))
            if end is not None:
                return end
        return None


class PromptLookup:
    """Prompt lookup (n-gram) drafting: find the last few tokens earlier in the context
    (prompt or generated text) and propose what followed them there. Answers that quote
    their context (code edits, tool output) are accepted in long runs."""

    def __init__(self, min_n: int = 1, max_n: int = 3):
        self._min_n, self._max_n = min_n, max_n
        self._index = NgramIndex(min_n, max_n)
        self._seen: tuple[int, int, int] = (0, -1, -1)  # length, first and last token

    def propose(self, context: list[int], k: int) -> list[int]:
        if k <= 0 or len(context) < 2:
            return []
        # Called on every step (``controller.Shadow``): a context that goes on from the
        # last one is told by its ends, not by comparing it whole.
        n, first, last = self._seen
        if n > len(context) or (n and (context[0] != first or context[n - 1] != last)):
            self._index = NgramIndex(self._min_n, self._max_n)  # another sequence's context
        self._seen = (len(context), context[0], context[-1])
        # An n-gram ending at the last position is the query itself: index only those with
        # at least one token after them.
        self._index.extend(context, len(context))
        return self._lookup(context, k)

    def propose_ahead(self, context: list[int], k: int) -> list[int]:
        """``propose`` for a context that goes on from the last one by tokens not
        confirmed yet: looked up in what is indexed, which stays as it is (nothing for a
        context this lookup does not follow)."""
        n, first, last = self._seen
        if k <= 0 or not n or n > len(context) or context[0] != first or context[n - 1] != last:
            return []
        return self._lookup(context, k)

    def _lookup(self, context: list[int], k: int) -> list[int]:
        """What followed the longest indexed match of ``context``'s last tokens."""
        end = self._index.find(context[-self._max_n :])
        if end is None or end >= len(context):
            return []
        return context[end : end + k]


class PredictedOutput:
    """The client's expected output (OpenAI's Predicted Outputs) as the draft.

    A cursor follows the prediction while the generated tokens agree with it; where they
    part (the edit), the cursor is found again by looking the last generated tokens up in
    the prediction, preferring the first match past where it was lost.
    """

    # The client expects the answer to follow it: drafting starts at once (a shadowed
    # drafter's rate otherwise starts at 0), and stops within two steps if it does not.
    prior = 0.9

    def __init__(self, prediction: list[int], prompt_len: int, max_n: int = 4):
        self.prediction = prediction
        self._start = prompt_len  # generated tokens begin here in the context
        self._seen = prompt_len  # context tokens already followed
        self._cursor: int | None = 0  # prediction index expected next (None: lost)
        self._hint = 0  # where the cursor was when it was lost
        self._max_n = max_n
        self._positions: dict[tuple[int, ...], list[int]] = {}
        for end in range(1, len(prediction)):
            for n in range(1, min(max_n, end) + 1):
                self._positions.setdefault(tuple(prediction[end - n : end]), []).append(end)

    def propose(self, context: list[int], k: int) -> list[int]:
        self._follow(context)
        if k <= 0 or self._cursor is None:
            return []
        return self.prediction[self._cursor : self._cursor + k]

    def propose_ahead(self, context: list[int], k: int) -> list[int]:
        """``propose`` for a context not confirmed yet; the cursor stays where it was."""
        saved = self._seen, self._cursor, self._hint
        try:
            return self.propose(context, k)
        finally:
            self._seen, self._cursor, self._hint = saved

    def _follow(self, context: list[int]) -> None:
        for tok in context[self._seen :]:
            c = self._cursor
            if c is not None and c < len(self.prediction) and self.prediction[c] == tok:
                self._cursor = c + 1
            else:
                self._hint = c if c is not None else self._hint
                self._cursor = None
        if self._cursor is None and len(context) > self._seen:
            self._cursor = self._realign(context[self._start :])
        self._seen = len(context)

    def _realign(self, generated: list[int]) -> int | None:
        last = self._hint
        for n in range(min(self._max_n, len(generated)), 0, -1):
            ends = self._positions.get(tuple(generated[-n:]))
            if ends:
                after = [e for e in ends if e > last]
                return after[0] if after else ends[-1]
        return None


def _forward(model: Any, tokens: list[int], cache: Any) -> mx.array:
    return model(mx.array(tokens)[None], cache=cache)[0, -1, :]


class DraftModel:
    """A smaller model with the same tokenizer proposes greedily from its own KV cache.

    The cache holds a prefix of the context (``self.fed``); on each call the part that no
    longer matches (rejected drafts) is taken off and the new context tokens fed. A cache
    that cannot be trimmed (a recurrent or full sliding-window layer) goes back to the
    state saved before the last draft; further back, it starts over.
    """

    def __init__(self, model: Any, prefill_step_size: int = 512):
        self.model = model
        self.cache: Any = make_prompt_cache(model)
        self.fed: list[int] = []
        self._step = prefill_step_size
        self._drafted: Rollback | None = None  # the state before the last draft's tokens
        self._drafted_at = 0  # len(fed) there

    def propose(self, context: list[int], k: int) -> list[int]:
        return self._draft(context, k, None)[0]

    def propose_sampled(
        self, context: list[int], k: int, rejection: Rejection
    ) -> tuple[list[int], mx.array | None]:
        """Up to ``k`` tokens sampled from the draft model's distribution (the request's
        temperature and truncation), and that distribution at each, (k, vocab)."""
        return self._draft(context, k, rejection)

    def _draft(
        self, context: list[int], k: int, rejection: Rejection | None
    ) -> tuple[list[int], mx.array | None]:
        if k <= 0 or not context:
            return [], None
        self._rewind(context)
        todo = context[len(self.fed) :]
        while len(todo) > self._step:  # a long new context prefills in chunks
            self.model(mx.array(todo[: self._step])[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
            self.fed += todo[: self._step]
            todo = todo[self._step :]
        out: list[int] = []
        dists: list[mx.array] = []
        logits = _forward(self.model, todo, self.cache)
        self.fed += todo
        self._drafted, self._drafted_at = Rollback(self.model, self.cache), len(self.fed)
        for i in range(k):
            if rejection is None:
                tok = int(mx.argmax(logits).item())  # type: ignore[arg-type]
            else:
                lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                dists.append(rejection.distribution(lp[None])[0])
                tok = rejection.draws.categorical(dists[-1])
            out.append(tok)
            if i + 1 < k:
                logits = self._drafted.feed([tok])[-1]
                self.fed.append(tok)
        return out, mx.stack(dists) if dists else None

    def _rewind(self, context: list[int]) -> None:
        common = 0
        limit = min(len(self.fed), len(context) - 1)  # keep at least one token to feed
        while common < limit and self.fed[common] == context[common]:
            common += 1
        if common == len(self.fed):
            return
        if self._drafted is not None and common >= self._drafted_at:
            self._drafted.keep(common - self._drafted_at)
        else:
            try:
                checked_trim(self.cache, len(self.fed) - common)
            except RollbackError:  # further back than the saved state: start over
                self.cache, common = make_prompt_cache(self.model), 0
        self._drafted = None
        del self.fed[common:]


def check_same_tokenizer(target: Any, draft: Any) -> None:
    """Raise ValueError unless the draft model's tokenizer maps text to the same token ids
    as the target's (same vocabulary, same end-of-sequence tokens): its drafts would
    otherwise be other tokens than they seem."""
    tv, dv = target.vocab, draft.vocab
    if tv != dv:
        differ = sum(1 for t, i in tv.items() if dv.get(t) != i) + len(set(dv) - set(tv))
        raise ValueError(
            "the draft model's tokenizer differs from the model's "
            f"({len(dv)} vs {len(tv)} tokens, {differ} differ); speculative decoding "
            "needs a draft model with the same tokenizer"
        )
    if sorted(target.eos_token_ids) != sorted(draft.eos_token_ids):
        raise ValueError(
            "the draft model's end-of-sequence tokens differ from the model's "
            f"({sorted(draft.eos_token_ids)} vs {sorted(target.eos_token_ids)})"
        )
