"""How many tokens to draft next: the width that maximises expected tokens per second.

With a per-token acceptance rate ``a`` (the chance a drafted token is accepted given the
ones before it were), a draft of ``k`` yields ``(1 - a**(k+1)) / (1 - a)`` tokens per step.
A step without a draft costs ``t0`` (measured on plain, pipelined steps); one that
verifies a pass of width ``w`` costs what such steps were measured to cost at this batch
size (``costs.StepCosts``), which includes the lost pipelining. Drafting stops when it
does not pay, and plain decoding is then exactly the runner's own.

The rate must stay current while nothing is drafted, or drafting could never start again.
A cheap drafter (prompt lookup, a predicted output: a few dict reads) is asked anyway on
plain steps, and its proposal is scored against the tokens plain decoding then emits
(``shadow.Shadow``): the rate it would have had, for free. Its rate starts at 0, so it drafts
only once its drafts have matched, and two verified tries in a row with nothing accepted
set it back to 0. So with nothing to accept drafting stops within two steps and stays
stopped, and it starts again as soon as the drafts match (after a predicted output's
edit, when an answer turns to quoting). A try where it has nothing to propose is no
rejection: the rate stays and the sequence pauses a few plain steps (``Acceptance.nothing``).
A draft model costs a forward pass per token: it is not shadowed, and instead backs off
(``Acceptance``): after two failed tries it stops for 4 steps, then 8, ... up to
``MAX_WAIT``, and probes with one token when the wait ends; one accepted token resets it.

Steps that draft without the plan expecting them to pay (a probe after backing off, a
batch's or a lone sequence's exploring step, which drafts now and then where the drafts
match but the measured cost says verifying does not pay, so that a cost measured too high
is measured again) are spaced by what they cost: at least ``spacing`` steps apart, so
that with nothing ever accepted they add at most ``PROBE_SHARE`` of plain decoding's time
(a pass measured at 6 plain steps probes once in 167 steps, one at 1.15 once in 5).

``DraftLength`` is the lone sequence's controller; ``BatchPlan`` picks one width for a
batch (each row drafts at most that many, padded to it). Both report each decision to a
``plan_log.PlanLog`` when given one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from mlx_server.engine.speculative import plan_log as why
from mlx_server.engine.speculative.costs import StepCosts
from mlx_server.engine.speculative.plan_log import PlanLog

FIRST_WAIT = 4  # steps without drafting after the first failures (a draft model)
MAX_WAIT = 256
FAILS_BEFORE_WAIT = 2
EMA = 0.2  # per scored position: a run of 8 accepted tokens lifts a rate of 0 to 0.83
PRIOR = 0.6  # the rate of a drafter not shadowed, before its first try
NOTHING_WAIT = 8  # the longest pause after tries with nothing to propose (``nothing``)
PROBE_SHARE = 0.03  # of plain decoding's time, the most that probing steps may add


def spacing(costs: StepCosts, batch: int, width: int) -> int:
    """Steps between two probing passes of ``width`` at ``batch`` rows, so that passes
    which yield nothing add at most ``PROBE_SHARE`` of plain decoding's time."""
    cost, t0 = costs.cost(batch, width), costs.t0.get(batch)
    if not cost or not t0:
        return 0
    return math.ceil((cost / t0 - 1) / PROBE_SHARE)


class Acceptance:
    """One sequence's drafting record: its acceptance rate and, for a drafter that is not
    shadowed (``backs_off``), its back-off."""

    def __init__(self, prior: float = PRIOR, backs_off: bool = True):
        self.rate = prior  # acceptance per drafted token, moving average over positions
        self.backs_off = backs_off
        self.fails = 0  # tries in a row with nothing accepted
        self.wait = 0  # steps left before the next try
        self.due = False  # a wait just ended: the next step tries, whatever the costs say
        self._next_wait = FIRST_WAIT
        self._nothing_wait = 1  # plain steps after a try with nothing to propose (``nothing``)

    @property
    def ready(self) -> bool:
        """Whether this sequence may try to draft at this step."""
        return self.wait == 0

    def tick(self) -> None:
        """A step passed without this sequence trying."""
        if self.wait > 0:
            self.wait -= 1
            self.due = self.wait == 0 and self.backs_off  # a shadowed drafter never probes

    def observe(self, drafted: int, accepted: int) -> None:
        """Move the rate: of a draft of ``drafted`` (0: the drafter had nothing, which
        costs a try as a rejected token does), ``accepted`` were accepted. Accepted tokens
        form a prefix, so the positions scored are those and the first rejected one."""
        tries = min(max(drafted, 1), accepted + 1)
        keep = (1 - EMA) ** tries
        hits = accepted / tries if tries else 0.0
        self.rate = keep * self.rate + (1 - keep) * hits

    def record(self, drafted: int, accepted: int) -> None:
        """A real try: the rate moves, and a failure counts towards backing off."""
        self.due = False
        self.observe(drafted, accepted)
        if drafted > 0:
            self._nothing_wait = 1
        if accepted > 0:
            self.fails = 0
            self._next_wait = FIRST_WAIT
        else:
            self.fails += 1
            if self.fails >= FAILS_BEFORE_WAIT:
                if self.backs_off:
                    self.back_off()
                else:  # stop at once: the shadow drafts earn the rate back
                    self.rate = 0.0

    def nothing(self) -> None:
        """A try at which a shadowed drafter had nothing to propose (a code edit's new
        name: no n-gram of it in the prompt yet). Nothing was verified, so the rate, the
        acceptance of its drafts, stays; asking again costs the next step its pipelining
        (the drafter needs the token in flight), so the sequence decodes plainly for 1, then
        2, 4, up to ``NOTHING_WAIT`` steps, its shadow drafts scored meanwhile. Counting it
        as a rejection set the rate to 0 after two such steps: on the H100 the demo model's
        code edit then drafted 90 of 200 tokens, 99 % of them accepted."""
        self.due = False
        self.wait = self._nothing_wait
        self._nothing_wait = min(2 * self._nothing_wait, NOTHING_WAIT)

    def back_off(self) -> None:
        """Stop trying for a while; each back-off in a row waits twice as long."""
        self.wait = self._next_wait
        self._next_wait = min(2 * self._next_wait, MAX_WAIT)
        self.due = False


class DraftLength:
    """The lone sequence's draft width: its ``Acceptance`` and the step costs of a batch of
    one. ``next_k`` before each step; ``record`` after a step that tried to draft,
    ``record_plain`` after a pipelined one that did not."""

    REFRESH_EVERY = 128  # steps: two plain steps measure t0 afresh

    def __init__(
        self,
        max_k: int,
        *,
        prior: float | None = None,
        shadowed: bool = False,
        costs: StepCosts | None = None,
        log: PlanLog | None = None,
    ):
        self.max_k = max_k
        if prior is None:  # a shadowed drafter earns its rate before its first try
            prior = 0.0 if shadowed else PRIOR
        self.acceptance = Acceptance(prior, backs_off=not shadowed)
        self.costs = costs if costs is not None else StepCosts(max_k)
        self.log = log
        self._steps = 0
        self._drafted_at = 0  # the step that last verified a draft
        self._drafting = False  # the last decision drafted (a stop is logged once)
        if log is not None:
            log.watch(self.costs)

    @property
    def rate(self) -> float:
        return self.acceptance.rate

    def next_k(self) -> int:
        if self.max_k <= 0:
            return 0
        self._steps += 1
        acc = self.acceptance
        # Plain steps in a row measure t0: the first ones, and two now and then.
        if not self.costs.measured(1) or self._steps % self.REFRESH_EVERY in (1, 2):
            acc.tick()
            return self._plain(why.MEASURING)
        if not acc.ready:
            acc.tick()
            return self._plain(why.BACKING_OFF if acc.backs_off else why.PAUSED)
        k = self.costs.best(1, [acc.rate], [self.max_k])
        if k > 0:
            return self._draft(k, why.DRAFTS)
        if acc.due:  # a probe: the text may have turned repetitive
            if self._steps - self._drafted_at >= spacing(self.costs, 1, 1):
                return self._draft(1, why.PROBE)
            return self._plain(why.BACKING_OFF)  # too soon for what a pass costs
        if acc.backs_off:
            acc.back_off()  # it does not pay at this rate: wait, then probe
        free = self.costs.best(1, [acc.rate], [self.max_k], free=True)
        if free and not acc.backs_off:  # the drafts match: is the measured cost still right?
            every = max(BatchPlan.EXPLORE_EVERY, spacing(self.costs, 1, free))
            if self._steps - self._drafted_at >= every:
                return self._draft(free, why.EXPLORE)
        return self._plain(why.COST if free else why.RATE)

    def _draft(self, k: int, reason: str) -> int:
        self._drafting = True
        if self.log is not None:
            self.log.decided(reason)
        return k

    def _plain(self, reason: str) -> int:
        if self.log is not None:
            self.log.decided(reason)
            if self._drafting and reason != why.MEASURING:
                cost = self.costs.cost(1, self.max_k)
                t0 = self.costs.t0.get(1) or 0.0
                ratio = cost / t0 if cost and t0 else 0.0
                self.log.stopped(
                    f"{reason} (rate {self.rate:.2f}, width {self.max_k} costs {ratio:.2f} steps)"
                )
        self._drafting = False
        return 0

    def record(self, drafted: int, accepted: int, seconds: float, width: int = 0) -> None:
        """A step that tried to draft: ``drafted`` proposed (0: none), ``accepted`` kept,
        and (``seconds``, counted only when there was a draft) its pass of ``width``."""
        if drafted or self.acceptance.backs_off:
            self.acceptance.record(drafted, accepted)
        else:  # a shadowed drafter with nothing to propose: no rejection, a pause
            self.acceptance.nothing()
        if drafted:
            self._drafted_at = self._steps
            self.costs.record_verify(1, width or drafted, seconds)
            if self.log is not None:
                self.log.verified(drafted, accepted, seconds)
        elif self.log is not None:
            self.log.decided(why.NO_DRAFT)

    def record_plain(self, seconds: float) -> None:
        """A pipelined step without a draft took ``seconds``."""
        self.costs.record_plain(1, seconds)


class BatchPlan:
    """One width for the whole batch: each row is padded to it, so a row whose draft is
    shorter (or empty) costs the batch as much as a full one; the width that maximises the
    batch's expected tokens per second wins, zero when verifying does not pay at this
    batch size. Shadowed rows draft as soon as their rates say it pays; otherwise the
    batch backs off as a row does (``tries``: after two verifying steps with nothing
    accepted, wait 4, 8, ... steps), so the unaligned probes of rows that back off (a
    draft model's) do not each cost it a step. Now and
    then (``EXPLORE_EVERY`` steps at a batch size that does not draft, while some row's
    drafts are accepted at all; for shadowed rows, while their rates say a free pass would
    pay) one step drafts anyway, to measure its cost afresh. Those
    two, and a try after backing off, come at most once in ``spacing`` steps."""

    EXPLORE_EVERY = 64  # at least; and never more often than ``spacing`` (PROBE_SHARE)
    EXPLORE_RATE = 0.1

    def __init__(self, max_k: int, costs: StepCosts | None = None, log: PlanLog | None = None):
        self.max_k = max_k
        self.costs = costs if costs is not None else StepCosts(max_k)
        self.log = log
        self.tries = Acceptance()  # the batch's own back-off for probes (its rate is unused)
        self._undrafted: dict[int, int] = {}  # steps since the last drafting one, by size
        self._forced = False  # this step drafts whatever the costs say (probe, explore)
        self._drafting = False  # the last decision drafted (a stop is logged once)
        self._step: tuple[int, list[float]] = (0, [])  # this step's batch size and rates
        if log is not None:
            log.watch(self.costs)

    def worth_trying(self, rows: Sequence[Acceptance | None]) -> bool:
        """Before reading the batch's tokens: could drafting pay at this step, if every
        ready row drafted ``max_k``? (Reading them costs the step its pipelining.)"""
        self._forced = False
        b = len(rows)
        since = self._undrafted[b] = self._undrafted.get(b, 0) + 1
        if self.max_k <= 0 or not self.costs.measured(b):
            return self._say(False, why.MEASURING)
        rates = [r.rate if r is not None else 0.0 for r in rows]
        self._step = (b, rates)
        # Shadowed rows' rates are current: they draft as soon as it pays.
        shadowed = [
            self.max_k if r is not None and not r.backs_off and r.ready else 0 for r in rows
        ]
        if any(shadowed) and self.costs.best(b, rates, shadowed) > 0:
            return self._say(True, why.DRAFTS)
        if all(r is None or not r.backs_off for r in rows):  # no row probes: rates decide
            paid = self.costs.best(b, rates, shadowed, free=True)
            if paid and self._explore(b, since, rates):  # is the measured cost still right?
                return self._say(True, why.EXPLORE)
            if not paid and any(r is not None and not r.ready for r in rows):
                return self._say(False, why.PAUSED)  # rows whose drafters had nothing wait
            return self._say(False, why.COST if paid else why.RATE)
        if not self.tries.ready:
            self.tries.tick()
            return self._say(False, why.BACKING_OFF)
        lengths = [self.max_k if r is not None and r.ready else 0 for r in rows]
        if not any(lengths):
            return self._say(False, why.BACKING_OFF)
        k = self.costs.best(b, rates, lengths)
        if k > 0:
            if self.tries.fails and since < spacing(self.costs, b, k):
                return self._say(False, why.BACKING_OFF)  # a try after failures: too soon
            return self._say(True, why.DRAFTS)
        if self._explore(b, since, rates):
            return self._say(True, why.EXPLORE)
        paid = self.costs.best(b, rates, lengths, free=True)
        return self._say(False, why.COST if paid else why.RATE)

    def _explore(self, b: int, since: int, rates: list[float]) -> bool:
        """Whether this step drafts anyway, to measure the pass's cost afresh: once in
        ``EXPLORE_EVERY`` steps at this batch size, and no more often than ``spacing``."""
        explore = max(self.EXPLORE_EVERY, spacing(self.costs, b, self.max_k))
        if since < explore or max(rates) < self.EXPLORE_RATE:
            return False
        self._forced = True
        self._undrafted[b] = 0  # counted from here, whether or not rows had drafts
        return True

    def _say(self, drafts: bool, reason: str) -> bool:
        if self.log is not None:
            self.log.decided(reason)
            if self._drafting and not drafts and reason != why.MEASURING:
                b, rates = self._step
                cost = self.costs.cost(b, self.max_k)
                t0 = self.costs.t0.get(b) or 0.0
                ratio = cost / t0 if cost and t0 else 0.0
                top = max(rates, default=0.0)
                self.log.stopped(
                    f"{reason} (batch {b}, best rate {top:.2f}, "
                    f"width {self.max_k} costs {ratio:.2f} steps)"
                )
        self._drafting = drafts
        return drafts

    def choose(self, rows: Sequence[Acceptance | None], lengths: Sequence[int]) -> int:
        """The width for the step, given each row's available draft length."""
        top = max(lengths, default=0)
        if self._forced:
            return top
        rates = [r.rate if r is not None else 0.0 for r in rows]
        return self.costs.best(len(rows), rates, lengths)

    def record_try(self, drafted: int, accepted: int) -> None:
        """A step that read the batch's tokens to draft: ``drafted`` tokens verified in
        all rows (0: none worth it), ``accepted`` of them."""
        self.tries.record(drafted, accepted)
        if not drafted and self.log is not None:
            self.log.decided(why.NO_DRAFT)

    def record_plain(self, batch: int, seconds: float) -> None:
        self.costs.record_plain(batch, seconds)

    def record_draft(self, batch: int, width: int, seconds: float) -> None:
        self._undrafted[batch] = 0
        self.costs.record_verify(batch, width, seconds)
