"""Speculation inside mlx-lm's continuous batching: which rows draft, and when it pays.

``SpeculativeGenerationBatch`` is mlx-lm's ``GenerationBatch`` with one change: its
``next`` asks a ``BatchSpeculator`` first. The speculator decides each step, from every
row's acceptance and the batch's measured step costs (``controller.BatchPlan``), whether
to verify drafts; if not, the step is mlx-lm's own (pipelined: queued before the previous
token is read). If so, it reads the rows' pending tokens, asks each speculating row's
drafter for a draft, and runs one verifying step for the whole batch
(``batch_verify.verify_batch``); rows without a drafter, or without a draft this step,
take part with their one token. Everything else (prefill, joining, removal, the caches
handed to the prefix cache) stays mlx-lm's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch

from mlx_server.engine.speculative.batch_verify import Sampled, can_roll_back, verify_batch
from mlx_server.engine.speculative.controller import PRIOR, Acceptance, BatchPlan
from mlx_server.engine.speculative.costs import StepCosts
from mlx_server.engine.speculative.drafters import Drafter, DraftModel
from mlx_server.engine.speculative.plan_log import PlanLog
from mlx_server.engine.speculative.rejection import Rejection
from mlx_server.engine.speculative.shadow import Shadow


@dataclass
class RowSpec:
    """A speculating row: its drafter and its drafting record. A cheap drafter (not a
    model) is shadowed on plain steps (``controller.Shadow``) and never backs off."""

    drafter: Drafter
    acceptance: Acceptance | None = None
    rejection: Rejection | None = None  # a draft model sampling at the request's temperature
    shadow: Shadow | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.acceptance is None:  # a shadowed drafter earns its rate before a try
            prior = getattr(self.drafter, "prior", 0.0 if self.cheap else PRIOR)
            self.acceptance = Acceptance(prior, backs_off=not self.cheap)
        if self.cheap and self.shadow is None:
            self.shadow = Shadow()
            self.acceptance.backs_off = False

    @property
    def cheap(self) -> bool:
        """Drafting costs next to nothing (a lookup, not a model)."""
        return not isinstance(self.drafter, DraftModel)

    @property
    def record(self) -> Acceptance:
        assert self.acceptance is not None
        return self.acceptance


class BatchSpeculator:
    """The speculating rows of one ``BatchGenerator`` (by its uids) and the step plan."""

    def __init__(
        self,
        max_k: int,
        *,
        adaptive: bool = True,
        model: Any = None,
        extra_processors: Callable[[int], tuple[Any, ...]] | None = None,
        costs: StepCosts | None = None,
        log: PlanLog | None = None,
    ):
        """``model``: what verifies (default the batch's own, which may be a wrapper that
        expects one position per row); ``extra_processors``: a row's logits processors
        kept outside mlx-lm's per-row list (the batch runner's grammars), by uid;
        ``costs``: the step costs measured so far (kept across generators)."""
        self.max_k = max_k
        self.model = model
        self.extra_processors = extra_processors
        self.rows: dict[int, RowSpec] = {}
        self.adaptive = adaptive
        self.log = log
        plan = BatchPlan if adaptive else AlwaysDraft
        self.plan: BatchPlan = plan(max_k, costs, log)
        self.counts: dict[int, tuple[int, int]] = {}  # uid -> drafted, accepted: last step
        self._plain_run = 0  # plain steps in a row (from the second on, they are timed)
        self._plain_size = 0  # at this batch size
        self._sampled: dict[int, Sampled] = {}  # this step's sampled drafts, by row

    def next(self, batch: GenerationBatch) -> list[Any]:
        self.counts = {}
        specs = [self.rows.get(u) for u in batch.uids]
        accs = [s.record if s is not None else None for s in specs]
        if not can_roll_back(batch.prompt_cache) or not self.plan.worth_trying(accs):
            return self._plain(batch, specs)
        self._plain_run = 0
        for s in specs:
            if s is not None and s.shadow is not None:
                s.shadow.drop()
        mx.eval(batch._next_tokens)  # the last plain step's work, not this one's
        t = time.perf_counter()
        pending: list[int] = batch._next_tokens.tolist()  # type: ignore[assignment]
        self._sampled = {}
        drafts = self._drafts(batch, specs, pending)
        k = self.plan.choose(accs, [len(d) for d in drafts])
        tried = [s is not None and self._ready(s) for s in specs]
        if k == 0:
            for s, was in zip(specs, tried, strict=True):
                if s is not None and was:
                    _unverified(s)
            self.plan.record_try(0, 0)
            return GenerationBatch.next(batch)
        drafts = [d[:k] for d in drafts]
        uids = list(batch.uids)
        width = self.plan.costs.width(len(uids), max(len(d) for d in drafts))
        if self.log is not None:
            self.log.verifying(len(uids), width, [len(d) for d in drafts])
        timings: dict[str, float] | None = {} if self.log and self.log.trace else None
        responses = verify_batch(
            batch,
            pending,
            drafts,
            self._sampled,
            model=self.model,
            processors=self._processors(batch),
            width=width,
            timings=timings,
        )
        seconds = time.perf_counter() - t
        if self.log is not None and timings:
            self.log.phases(seconds, timings)
        self.plan.record_draft(len(uids), width, seconds)
        self._record(uids, specs, tried, drafts, responses, seconds)
        return responses

    def _processors(self, batch: GenerationBatch) -> list[Sequence[Any]]:
        """Each row's processors: those kept outside mlx-lm's list first (a grammar, which
        the batch's decode step applies before the list), then the list."""
        extra = self.extra_processors
        lists: list[Any] = batch.logits_processors or [()] * len(batch.uids)
        return [
            (*(extra(uid) if extra is not None else ()), *(listed or ()))
            for uid, listed in zip(batch.uids, lists, strict=True)
        ]

    def _ready(self, s: RowSpec) -> bool:
        return s.record.ready or not self.adaptive

    def _plain(self, batch: GenerationBatch, specs: list[RowSpec | None]) -> list[Any]:
        for s in specs:
            if s is not None:
                s.record.tick()
        size = len(batch.uids)
        timed = self._plain_run > 0 and self._plain_size == size
        t = time.perf_counter()
        responses: list[Any] = GenerationBatch.next(batch)
        if timed:
            self.plan.record_plain(size, time.perf_counter() - t)
        self._plain_run += 1
        self._plain_size = size
        if self.adaptive:
            self._shadow(batch, responses)
        return responses

    def _shadow(self, batch: GenerationBatch, responses: list[Any]) -> None:
        """Score the cheap rows' open shadow drafts against this step's tokens; rows with
        none open (and still running) ask their drafters for the next."""
        running = {uid: i for i, uid in enumerate(batch.uids)}
        for r in responses:
            s = self.rows.get(r.uid)
            if s is None or s.shadow is None:
                continue
            s.shadow.score(r.token, s.record, self.log)
            i = running.get(r.uid)
            if not s.shadow.open and i is not None and s.shadow.due():
                s.shadow.start(s.drafter.propose(batch.tokens[i], self.max_k), s.record)

    def _drafts(
        self, batch: GenerationBatch, specs: list[RowSpec | None], pending: list[int]
    ) -> list[list[int]]:
        """The ready rows' drafts (at most ``max_k``, and what their max_tokens leave)."""
        out: list[list[int]] = []
        for i, s in enumerate(specs):
            cap = min(self.max_k, batch.max_tokens[i] - batch._num_tokens[i] - 1)
            if s is None or not self._ready(s) or cap <= 0:
                out.append([])
                continue
            out.append(self._propose(i, s, [*batch.tokens[i], pending[i]], cap))
        return out

    def _propose(self, i: int, s: RowSpec, context: list[int], k: int) -> list[int]:
        """Row ``i``'s draft; a sampled one's distribution goes to ``_sampled``."""
        if s.rejection is not None and isinstance(s.drafter, DraftModel):
            draft, q = s.drafter.propose_sampled(context, k, s.rejection)
            if draft and q is not None:
                self._sampled[i] = (q, s.rejection)
            return draft
        return s.drafter.propose(context, k)[:k]

    def _record(
        self,
        uids: list[int],
        specs: list[RowSpec | None],
        tried: list[bool],
        drafts: list[list[int]],
        responses: list[Any],
        seconds: float,
    ) -> None:
        emitted: dict[int, int] = {}
        for r in responses:
            emitted[r.uid] = emitted.get(r.uid, 0) + 1
        total = [0, 0]
        for uid, s, was, d in zip(uids, specs, tried, drafts, strict=True):
            if s is None:
                continue
            accepted = min(len(d), emitted.get(uid, 1) - 1)
            if was and not d:
                _unverified(s)
            elif was:
                s.record.record(len(d), accepted)
            else:
                s.record.tick()
            self.counts[uid] = (len(d), accepted)
            total[0] += len(d)
            total[1] += accepted
        self.plan.record_try(*total)
        if self.log is not None:
            self.log.verified(total[0], total[1], seconds)


def _unverified(s: RowSpec) -> None:
    """A row that was asked at a drafting step and had nothing verified: its drafter had
    nothing to propose, or the plan found the step's drafts not worth a pass. A cheap
    drafter's rate stays (nothing it proposed was wrong) and the row pauses
    (``Acceptance.nothing``), as a lone sequence does; a draft model's try fails (it backs
    off). Counting these as rejections set every row's rate to 0 after two such steps: on
    the H100 the demo model's code edit at 8 streams drafted 14 tokens of 1,600, with 700
    of its 813 shadow drafts matching."""
    if s.cheap:
        s.record.nothing()
    else:
        s.record.record(0, 0)


class AlwaysDraft(BatchPlan):
    """Every step verifies the longest draft the rows have (tests, benchmarks)."""

    def worth_trying(self, rows: Sequence[Acceptance | None]) -> bool:
        return any(r is not None for r in rows)

    def choose(self, rows: Sequence[Acceptance | None], lengths: Sequence[int]) -> int:
        return max(lengths, default=0)

    def record_try(self, drafted: int, accepted: int) -> None:
        pass  # never backs off


class SpeculativeGenerationBatch(GenerationBatch):
    """mlx-lm's generation batch whose steps may verify drafts (see the module docstring)."""

    speculator: BatchSpeculator | None = None

    def next(self) -> list[Any]:
        spec = self.speculator
        if spec is None or not self.uids or not spec.rows:
            return super().next()
        return spec.next(self)


def install(gen: BatchGenerator, speculator: BatchSpeculator) -> SpeculativeGenerationBatch:
    """Make ``gen``'s running batch a speculating one, in place: the object stays (so what
    holds it, such as a wrapper of its model, still does), its class becomes the
    speculating subclass, which adds no state of its own. Prefilled sequences join it
    through ``extend``, so it stays this object for the generator's life."""
    batch = gen._generation_batch
    batch.__class__ = SpeculativeGenerationBatch
    assert isinstance(batch, SpeculativeGenerationBatch)
    batch.speculator = speculator
    return batch
