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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream

from mlx_server.engine.runners.base import Insert, Progress, Response
from mlx_server.engine.runners.solo import SoloSequence
from mlx_server.engine.speculative.controller import DraftLength
from mlx_server.engine.speculative.costs import StepCosts, bucket
from mlx_server.engine.speculative.drafters import Drafter, DraftModel
from mlx_server.engine.speculative.plan_log import PlanLog
from mlx_server.engine.speculative.rejection import Rejection
from mlx_server.engine.speculative.shadow import Shadow
from mlx_server.engine.speculative.verify import Processor, Verified, verify, verify_sampled
from mlx_server.types import GenerationRequest


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

    def next(self) -> tuple[list[Progress], list[Response]]:
        with mx.stream(generation_stream):
            if len(self._todo) > 1:
                return [self._prefill_chunk()], []
            left = self._max_tokens - self.emitted - (self._next is not None)
            k = min(self.length.next_k() if self._adaptive else self._num_draft, left - 1)
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
        draft, out = self._verify(last, k)
        if out is None:
            self.length.record(0, 0, 0.0)
            return [*head, self._decode()]
        self._context = None  # the processors' token buffer is rebuilt from ``fed``
        width = bucket(len(draft), max(self._num_draft, len(draft)))
        self.length.record(len(draft), out.accepted, time.perf_counter() - t, width)
        self.draft_n += len(draft)
        self.draft_accepted += out.accepted
        responses = self._answer(last, out)
        responses[0].drafted, responses[0].draft_accepted = len(draft), out.accepted
        return [*head, *responses]

    def _verify(self, last: int, k: int) -> tuple[list[int], Verified | None]:
        """Draft up to ``k`` tokens after ``last`` and verify them (None: no draft)."""
        context = [*self.fed, last]
        if self.rejection is not None and isinstance(self.drafter, DraftModel):
            draft, q = self.drafter.propose_sampled(context, k, self.rejection)
            if not draft or q is None:
                return [], None
            pad = self._padding(len(draft))
            out = verify_sampled(self.model, self.cache, last, draft, q, self.rejection, pad)
            return draft, out
        draft = self.drafter.propose(context, k)[:k]
        if not draft:
            return [], None
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
            pad=self._padding(len(draft)),
            timings=timings,
        )
        if log is not None and timings:
            log.phases(time.perf_counter() - t, timings)
        return draft, out

    def _padding(self, n: int) -> int:
        """Positions the pass adds after a draft of ``n`` (``costs.bucket``: passes of a
        few shapes, which repeat); logged first, so a pass that brings the process down
        is on record."""
        width = bucket(n, max(self._num_draft, n))
        log = self.length.log
        if log is not None:
            log.verifying(1, width, [n])
        return width - n

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
