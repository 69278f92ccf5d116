"""A lone sequence that speculates: the lone-request runner, drafting and verifying.

It is a ``solo.SoloSequence`` (prefill in chunks, pipelined decoding) whose decode steps
may draft: ``controller.DraftLength`` picks ``k`` for each step. With ``k`` zero the step
is the solo sequence's own, queued before its token is read, so a sequence whose drafts
are not accepted (the controller backs off) decodes at the solo runner's speed. With ``k``
above zero the pending token is read, the drafter proposes up to ``k`` tokens after it,
one forward pass verifies them (``verify.verify``), and the step answers with every token
it emitted, one response each. Such a step is not pipelined: what to feed next depends on
the acceptance. After it the KV cache holds exactly ``fed`` and ``_todo`` the last emitted
token, which the next step (of either kind) feeds first; a handover to the batch
(``handover``) works from either state as for the solo sequence.

Passes are pipelined where they can be (``pipelined``: a lookup or a prediction drafting, the
choice made in the pass's own graph, a cache that trims exactly): before a pass is read, the
next one is queued behind it on the hypothesis that it is accepted whole, fed the pass's
own last choice (not read yet: an array of the device's) and the drafter's guess after it,
so the device runs the next pass while this one is read, answered and the one after built,
as plain decoding queues its next step. Where the hypothesis fails (a token rejected, the
sequence ends) the queued pass is dropped and the cache trimmed back; a pass queued behind
another is exact whatever was guessed (it verifies its own draft after the actual token).
While one is queued the cache holds more than ``fed`` (``ahead``); anything that takes the
cache drops it first (``settle``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream

from mlx_server.engine.runners.base import Insert, Progress, Response
from mlx_server.engine.runners.solo import SoloSequence
from mlx_server.engine.sampling.samplers import SharedSampler
from mlx_server.engine.speculative.controller import DraftLength
from mlx_server.engine.speculative.costs import StepCosts, bucket
from mlx_server.engine.speculative.drafters import Drafter, DraftModel, propose_ahead
from mlx_server.engine.speculative.plan_log import PhaseClock, PlanLog
from mlx_server.engine.speculative.rejection import Rejection
from mlx_server.engine.speculative.rollback import Rollback, needs_saving
from mlx_server.engine.speculative.shadow import Shadow
from mlx_server.engine.speculative.verify import (
    Processor,
    Verified,
    queue_pass,
    verify,
    verify_sampled,
)
from mlx_server.types import GenerationRequest


@dataclass
class _Pass:
    """A verify pass queued on the device, not read yet (pipelined decoding)."""

    first: int  # the token fed first (-1 while it is the pass before's choice, unread)
    draft: list[int]
    width: int  # the pass's positions after ``first``: the draft and its padding
    rollback: Rollback  # the cache before it, and what it fed
    logprobs: mx.array  # (len(draft) + 1, vocab)
    choice: mx.array  # (len(draft) + 1,): the target's token at each position
    # Host seconds spent building and dispatching it behind the pass before (queued), timed
    # with that one's read and charged to this one: each pass's sample is its own host
    # work and its wait, as a pipelined plain step's is.
    launch_s: float = 0.0

    @property
    def padded(self) -> bool:
        return self.width > len(self.draft)


class SpeculativeSequence(SoloSequence):
    """A lone sequence's prefill and speculative decode; see the module docstring."""

    def __init__(
        self,
        model: Any,
        uid: int,
        prompt: list[int],
        cached: int,
        cache: Any,
        *,
        sampler: Callable[[mx.array], mx.array],
        greedy: bool,
        drafter: Drafter,
        num_draft_tokens: int,
        max_tokens: int,
        eos: list[int],
        prefill_step_size: int,
        processors: Sequence[Processor] = (),
        system_end: int = 0,
        checkpoints: tuple[int, ...] = (),
        adaptive: bool = True,
        length: DraftLength | None = None,
        rejection: Rejection | None = None,
        buckets: bool = False,
        costs: StepCosts | None = None,
        log: PlanLog | None = None,
        pipelined: bool = True,
    ):
        request = GenerationRequest(f"speculative-{uid}", prompt, max_tokens)
        job = Insert(
            uid, request, prompt, cached, cache, sampler, list(processors), system_end,
            checkpoints=checkpoints,
        )  # fmt: skip
        super().__init__(model, job, eos, prefill_step_size, buckets)
        self.drafter = drafter
        # Sampled drafts verified by rejection sampling (a draft model, temperature > 0).
        self.rejection = rejection if isinstance(drafter, DraftModel) else None
        self._greedy = greedy
        # A cheap drafter is asked on plain steps too, its drafts scored, not verified.
        self._shadow = Shadow() if not isinstance(drafter, DraftModel) and adaptive else None
        self.length = length or DraftLength(
            num_draft_tokens,
            prior=getattr(drafter, "prior", None),
            shadowed=self._shadow is not None,
            costs=costs,
            log=log,
        )
        self._adaptive = adaptive
        self._num_draft = num_draft_tokens
        self._plain_run = 0  # plain steps in a row: from the second on, they are timed
        self.draft_n = 0  # tokens drafted
        self.draft_accepted = 0  # of those, accepted
        # Passes queued behind the one read (module docstring), where the request allows it
        # and every layer of the cache trims exactly.
        self._pipelined = (
            pipelined
            and self.rejection is None
            and not isinstance(drafter, DraftModel)
            and not self.processors
            and (greedy or isinstance(sampler, SharedSampler))
            and not any(needs_saving(c) for c in self.cache)
        )
        self._ahead: _Pass | None = None  # queued behind the pass being read
        self._decided: int | None = None  # the next step's width, decided when queuing
        self.passes_ahead = 0  # passes queued behind another (counted: tests, benchmarks)
        # the last pass read was accepted whole: the next is queued behind the one read only
        # then (a pass built on a rejected one is wasted work, on a busy device a step's)
        self._whole = False
        self.passes_dropped = 0  # of those, dropped (the one before was not accepted whole)

    @property
    def ahead(self) -> int:
        """Positions the cache holds beyond ``fed``: a pass queued and not read yet."""
        return len(self._ahead.rollback.fed) if self._ahead is not None else 0

    def settle(self, keep_decision: bool = False) -> None:
        """Drop a pass queued ahead: the cache then holds ``fed`` (before anything else
        takes the cache: a handover, a removal). ``keep_decision``: the next step's width,
        decided with it, still stands (the pass before it was not accepted whole)."""
        ahead, self._ahead = self._ahead, None
        if not keep_decision:
            self._decided = None
        if ahead is not None:
            ahead.rollback.keep(0)
            self.passes_dropped += 1
            if self.length.log is not None:
                self.length.log.dropped += 1

    def take_pending(self) -> Response | None:
        self.settle()
        return super().take_pending()

    def handover(self) -> tuple[list[int], Any, list[int], int]:
        self.settle()
        return super().handover()

    def next(self) -> tuple[list[Progress], list[Response]]:
        with mx.stream(generation_stream):
            if len(self._todo) > 1:
                return [self._prefill_chunk()], []
            if self._ahead is not None:  # queued behind the pass read last step
                return [], self._read(self._ahead, time.perf_counter())
            left = self._max_tokens - self.emitted - (self._next is not None)
            decided, self._decided = self._decided, None
            if decided is None:
                decided = self.length.next_k() if self._adaptive else self._num_draft
            k = min(decided, left - 1)
            if k <= 0:
                return [], [self._plain()]
            return [], self._speculate(k)

    def _plain(self) -> Response:
        t = time.perf_counter()
        timed = self._plain_run > 0 and self._next is not None  # a pipelined step
        r = self._decode()
        if timed:
            self.length.record_plain(time.perf_counter() - t)
        self._plain_run += 1
        if self._shadow is not None and r.finish_reason is None:
            self._shadow_step(r.token)
        return r

    def _shadow_step(self, token: int) -> None:
        """Score the open shadow draft against ``token``; with none open, ask the drafter
        for the next one (after ``fed``, which ends with ``token``)."""
        shadow, acc = self._shadow, self.length.acceptance
        assert shadow is not None
        shadow.score(token, acc, self.length.log)
        if not shadow.open and shadow.due():
            shadow.start(self.drafter.propose(self.fed, self._num_draft), acc)

    def _speculate(self, k: int) -> list[Response]:
        self._plain_run = 0
        if self._shadow is not None:
            self._shadow.drop()
        first = self.take_pending()  # the token the last plain step sampled, if any
        if first is not None and first.finish_reason is not None:
            return [first]
        head = [first] if first is not None else []
        t = time.perf_counter()
        last = self._todo[0]
        if self._pipelined:
            draft = self.drafter.propose([*self.fed, last], k)[:k]
            if draft:
                launched = self._launch(mx.array([last], dtype=mx.int32), last, draft)
                return [*head, *self._read(launched, t)]
            self.length.record(0, 0, 0.0)
            return [*head, self._decode()]
        draft, out, width = self._verify(last, k)
        if out is None:
            self.length.record(0, 0, 0.0)
            return [*head, self._decode()]
        self._context = None  # the processors' token buffer is rebuilt from ``fed``
        self.length.record(len(draft), out.accepted, time.perf_counter() - t, width)
        self.draft_n += len(draft)
        self.draft_accepted += out.accepted
        responses = self._answer(last, out)
        responses[0].drafted, responses[0].draft_accepted = len(draft), out.accepted
        return [*head, *responses]

    def _launch(self, first: mx.array, value: int, draft: list[int]) -> _Pass:
        """Queue a pass feeding ``first`` (``value``: its token, -1 while not read) and
        ``draft``, padded to its width, with the choice at each position in its graph."""
        width = self._width(len(draft))
        sampler = None if self._greedy else self.sampler
        rollback, logprobs, choice = queue_pass(
            self.model, self.cache, first, value, draft, width, sampler
        )
        return _Pass(value, draft, width, rollback, logprobs, choice)

    def _queue_ahead(self, current: _Pass) -> None:
        """Where ``current`` is likely to be accepted whole (the pass before it was, and it
        has no padding, which would sit in the next pass's context), decide the next step's
        width now and, when it drafts, queue its pass behind ``current``: fed its last
        choice and what the drafter guesses after it (module docstring). Elsewhere the next
        step decides after this one is read, with its outcome."""
        after = self.emitted + len(current.draft) + 1  # tokens emitted if accepted whole
        if current.padded or not self._whole or self._max_tokens - after <= 1:
            return
        decided = self.length.next_k() if self._adaptive else self._num_draft
        self._decided = decided
        k = min(decided, self._max_tokens - after - 1)
        if k <= 0:
            return
        context = [*self.fed, current.first, *current.draft]
        guess = propose_ahead(self.drafter, context, k + 1)  # the last choice, then a draft
        if len(guess) < 2:
            return
        self._ahead = self._launch(current.choice[-1:], -1, guess[1 : k + 1])
        self._decided = None
        self.passes_ahead += 1
        if self.length.log is not None:
            self.length.log.queued += 1

    def _read(self, current: _Pass, t: float) -> list[Response]:
        """Read ``current`` (the next pass queued first, where one pays), answer its tokens
        and leave the cache holding ``fed`` plus any pass queued ahead."""
        self._ahead = None
        log = self.length.log
        clock = PhaseClock({} if log is not None and log.trace else None)  # nothing evaluated
        queuing = time.perf_counter()
        self._queue_ahead(current)
        if self._ahead is not None:
            self._ahead.launch_s = time.perf_counter() - queuing
        clock.done("queue next")
        choice: list[int] = current.choice.tolist()  # type: ignore[assignment]
        clock.done("forward")  # the wait for it, less what ran under the queuing
        draft = current.draft
        n = 0
        while n < len(draft) and choice[n] == draft[n]:
            n += 1
        clock.done("decide")
        tokens = choice[: n + 1]
        self._whole = n == len(draft)
        out = Verified(tokens, [current.logprobs[i] for i in range(n + 1)], n, current.rollback)
        ends = self.emitted + len(tokens) >= self._max_tokens or any(
            tok in self._eos for tok in tokens
        )
        if n < len(draft) or ends:  # the pass queued ahead was built on what did not happen
            self.settle(keep_decision=True)
        current.rollback.keep(len(current.rollback.fed) if self._ahead else 1 + n)
        if self._ahead is not None:  # its first token is this pass's last, read now
            self._ahead.first = self._ahead.rollback.fed[0] = tokens[-1]
        self._context = None
        clock.done("roll back")
        seconds = time.perf_counter() - t
        if log is not None and clock.timings:
            log.phases(seconds, clock.timings)
        # Its cost: the time read here with its own launch, where the pass before queued it,
        # and without the next one's launch, where that one still stands (a dropped pass's
        # launch stays here: this pass's outcome wasted it).
        seconds += current.launch_s - (self._ahead.launch_s if self._ahead is not None else 0.0)
        self.length.record(len(draft), n, seconds, current.width)
        self.draft_n += len(draft)
        self.draft_accepted += n
        responses = self._answer(current.first, out)
        responses[0].drafted, responses[0].draft_accepted = len(draft), n
        return responses

    def _verify(self, last: int, k: int) -> tuple[list[int], Verified | None, int]:
        """Draft up to ``k`` tokens after ``last`` and verify them in a pass of the width
        returned (None: no draft)."""
        context = [*self.fed, last]
        if self.rejection is not None and isinstance(self.drafter, DraftModel):
            draft, q = self.drafter.propose_sampled(context, k, self.rejection)
            if not draft or q is None:
                return [], None, 0
            width = self._width(len(draft))
            pad = width - len(draft)
            out = verify_sampled(self.model, self.cache, last, draft, q, self.rejection, pad)
            return draft, out, width
        draft = self.drafter.propose(context, k)[:k]
        if not draft:
            return [], None, 0
        width = self._width(len(draft))
        log = self.length.log
        timings: dict[str, float] | None = {} if log is not None and log.trace else None
        t = time.perf_counter()
        out = verify(
            self.model,
            self.cache,
            last,
            draft,
            sampler=None if self._greedy else self.sampler,
            processors=self.processors,
            history=self.fed,
            pad=width - len(draft),
            timings=timings,
        )
        if log is not None and timings:
            log.phases(time.perf_counter() - t, timings)
        return draft, out, width

    def _width(self, n: int) -> int:
        """The width of the pass verifying a draft of ``n`` (positions after the token fed
        first: the draft, then padding): one of a few shapes, which repeat
        (``costs.bucket``), or a wider one measured to cost less (``StepCosts.width``);
        logged first, so a pass that brings the process down is on record."""
        costs = self.length.costs
        width = costs.width(1, n) if n <= costs.max_k else bucket(n, max(self._num_draft, n))
        if self.length.log is not None:
            self.length.log.verifying(1, width, [n])
        return width

    def _answer(self, last: int, out: Verified) -> list[Response]:
        """One response per emitted token, up to the first that ends the sequence; the cache
        and ``fed`` then hold the context up to (not including) the last one answered."""
        self.fed.append(last)
        self._todo = []
        responses: list[Response] = []
        for i, tok in enumerate(out.tokens):
            self.emitted += 1
            reason = "stop" if tok in self._eos else None
            if reason is None and self.emitted >= self._max_tokens:
                reason = "length"
            if reason is None and i < len(out.tokens) - 1:
                self.fed.append(tok)
                responses.append(Response(self.uid, tok, out.logprobs[i], None))
                continue
            if out.rollback is not None:  # the cache holds ``last`` and tokens before this
                out.rollback.keep(1 + i)
            self._todo = [tok]
            if reason is None:
                responses.append(Response(self.uid, tok, out.logprobs[i], None))
            else:
                responses.append(
                    Response(self.uid, tok, out.logprobs[i], reason, self.cache, list(self.fed))
                )
            break
        return responses
