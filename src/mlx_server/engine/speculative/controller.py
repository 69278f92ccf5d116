"""How many tokens to draft next: the count that maximises expected tokens per second.

With a per-token acceptance rate ``a`` (the chance a drafted token is accepted given the
ones before it were), a draft of ``k`` yields ``(1 - a**(k+1)) / (1 - a)`` tokens per step.
A step without a draft costs ``t0`` (measured on plain, pipelined steps); one with a draft
of ``k`` costs ``t0 + c*k`` (``c`` measured from the extra time of drafting steps, which
includes the lost pipelining). The count drops to zero when drafting does not pay.

Trying costs: a step that drafts cannot be queued before the previous token is read, so a
sequence whose drafts are not accepted backs off (``Acceptance``): after two failed tries
it stops drafting for a few steps, and each failed try after that doubles the wait
(exponential back-off, up to ``MAX_WAIT`` steps); one accepted token resets it. Random
text thus costs a try every few hundred tokens, and a sequence whose text turns
repetitive starts speculating again.

``DraftLength`` is the lone sequence's controller; ``BatchPlan`` picks one draft length
for a batch (each row drafts at most that many, padded to it), from every row's
acceptance and the batch's step costs by batch size.
"""

from __future__ import annotations

from collections.abc import Sequence

FIRST_WAIT = 4  # steps without drafting after the first failures
MAX_WAIT = 256
FAILS_BEFORE_WAIT = 2
MARGIN = 1.02  # drafting must beat plain decoding by this much: noise should not make it draft
EMA = 0.2


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a step yields with a draft of ``k`` at per-token acceptance ``rate``."""
    a = min(max(rate, 0.0), 0.999)
    return (1 - a ** (k + 1)) / (1 - a)


class Acceptance:
    """One sequence's drafting record: its acceptance rate and its back-off."""

    def __init__(self, prior: float = 0.6):
        self.rate = prior  # acceptance per drafted token, moving average
        self.fails = 0  # tries in a row with nothing accepted
        self.wait = 0  # steps left before the next try
        self.due = False  # a wait just ended: the next step tries, whatever the costs say
        self._next_wait = FIRST_WAIT

    @property
    def ready(self) -> bool:
        """Whether this sequence may try to draft at this step."""
        return self.wait == 0

    def tick(self) -> None:
        """A step passed without this sequence trying."""
        if self.wait > 0:
            self.wait -= 1
            self.due = self.wait == 0

    def record(self, drafted: int, accepted: int) -> None:
        """A draft of ``drafted`` (0: the drafter had nothing) got ``accepted`` tokens."""
        self.due = False
        if drafted > 0:
            # Accepted tokens form a prefix: accepted of the first accepted + 1 tries held.
            tries = min(drafted, accepted + 1)
            self.rate = (1 - EMA) * self.rate + EMA * (accepted / tries)
        if accepted > 0:
            self.fails = 0
        else:
            self.fails += 1
            if self.fails >= FAILS_BEFORE_WAIT:
                self.back_off()

    def back_off(self) -> None:
        """Stop trying for a while; each back-off in a row waits twice as long."""
        self.wait = self._next_wait
        self._next_wait = min(2 * self._next_wait, MAX_WAIT)
        self.due = False

    def paid(self) -> None:
        """Drafting paid off: the next back-off is a short one again."""
        self._next_wait = FIRST_WAIT


class StepCosts:
    """Measured step seconds by batch size: ``t0`` without a draft, ``per_token`` more for
    each drafted position."""

    def __init__(self) -> None:
        self.t0: dict[int, float] = {}
        self.per_token: dict[int, float] = {}

    def record_plain(self, batch: int, seconds: float) -> None:
        old = self.t0.get(batch)
        self.t0[batch] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def record_draft(self, batch: int, k: int, seconds: float) -> None:
        t0 = self.t0.get(batch)
        if t0 is None or k <= 0:
            return
        extra = max(0.0, (seconds - t0) / k)
        old = self.per_token.get(batch)
        self.per_token[batch] = extra if old is None else (1 - EMA) * old + EMA * extra

    def best(self, batch: int, rates: Sequence[float], lengths: Sequence[int]) -> int:
        """The draft length (0 to ``max(lengths)``) that maximises expected tokens per
        second for rows with these acceptance rates and draft lengths available (0: the row
        drafts nothing). Unmeasured costs: 0 until a plain step is measured, then the
        longest draft (one try measures the cost)."""
        top = max(lengths, default=0)
        t0 = self.t0.get(batch)
        if top == 0 or t0 is None or t0 <= 0:
            return 0
        c = self.per_token.get(batch)
        if c is None:
            return top
        best, best_speed = 0, len(rates) / t0
        for k in range(1, top + 1):
            tokens = sum(expected_tokens(r, min(k, n)) for r, n in zip(rates, lengths, strict=True))
            speed = tokens / (t0 + c * k)
            if speed > best_speed * MARGIN:
                best, best_speed = k, speed
        return best


class DraftLength:
    """The lone sequence's draft length: its ``Acceptance`` and the step costs of a batch
    of one. ``next_k`` before each step; ``record`` after a step that tried to draft,
    ``record_plain`` after a pipelined one that did not."""

    REFRESH_EVERY = 128  # steps: two plain steps measure t0 afresh

    def __init__(self, max_k: int, *, prior: float = 0.6):
        self.max_k = max_k
        self.acceptance = Acceptance(prior)
        self.costs = StepCosts()
        self._steps = 0
        self._counted = False  # the last try was one the cost model chose

    @property
    def rate(self) -> float:
        return self.acceptance.rate

    def next_k(self) -> int:
        if self.max_k <= 0:
            return 0
        self._steps += 1
        acc = self.acceptance
        # Plain steps in a row measure t0: the first ones, and two now and then.
        if 1 not in self.costs.t0 or self._steps % self.REFRESH_EVERY in (1, 2):
            acc.tick()
            return 0
        if not acc.ready:
            acc.tick()
            return 0
        k = self.costs.best(1, [acc.rate], [self.max_k])
        self._counted = k > 0
        if k > 0:
            return k
        if acc.due:  # a probe: the text may have turned repetitive
            return 1
        acc.back_off()  # it does not pay at this rate: wait, then probe
        return 0

    def record(self, drafted: int, accepted: int, seconds: float) -> None:
        """A step that tried to draft: ``drafted`` proposed (0: none), ``accepted`` kept,
        how long it took (``seconds``, counted only when there was a draft)."""
        self.acceptance.record(drafted, accepted)
        if accepted > 0 and self._counted:
            self.acceptance.paid()
        if drafted:
            self.costs.record_draft(1, drafted, seconds)

    def record_plain(self, seconds: float) -> None:
        """A pipelined step without a draft took ``seconds``."""
        self.costs.record_plain(1, seconds)


class BatchPlan:
    """One draft length for the whole batch: each row is padded to it, so a row whose
    draft is shorter (or empty) costs the batch as much as a full one; the length that
    maximises the batch's expected tokens per second wins, zero when the batch is busy
    enough that verifying no longer pays. Every row that drafts costs the batch a step
    that is not pipelined, so the batch backs off as a row does (``tries``: after two
    verifying steps with nothing accepted in any row, wait 4, 8, ... steps), whatever the
    rows' own schedules. Now and then (``EXPLORE_EVERY`` steps at a batch size that does
    not draft) one step drafts anyway, to measure its cost afresh."""

    EXPLORE_EVERY = 256

    def __init__(self, max_k: int):
        self.max_k = max_k
        self.costs = StepCosts()
        self.tries = Acceptance()  # the batch's own back-off (its rate is unused)
        self._undrafted: dict[int, int] = {}  # steps since the last drafting one, by size
        self._exploring = False

    def worth_trying(self, rows: Sequence[Acceptance | None]) -> bool:
        """Before reading the batch's tokens: could drafting pay at this step, if every
        ready row drafted ``max_k``? (Reading them costs the step its pipelining.)"""
        self._exploring = False
        b = len(rows)
        if self.max_k <= 0 or b not in self.costs.t0:
            return False
        if not self.tries.ready:
            self.tries.tick()
            return False
        if not any(r is not None and r.ready for r in rows):
            return False
        rates = [r.rate if r is not None else 0.0 for r in rows]
        lengths = [self.max_k if r is not None and r.ready else 0 for r in rows]
        if self.costs.best(b, rates, lengths) > 0:
            return True
        n = self._undrafted[b] = self._undrafted.get(b, 0) + 1
        self._exploring = n % self.EXPLORE_EVERY == 0
        return self._exploring

    def choose(self, rows: Sequence[Acceptance | None], lengths: Sequence[int]) -> int:
        """The draft length for the step, given each row's available draft length."""
        if self._exploring:
            return max(lengths, default=0)
        rates = [r.rate if r is not None else 0.0 for r in rows]
        return self.costs.best(len(rows), rates, lengths)

    def record_try(self, drafted: int, accepted: int) -> None:
        """A step that read the batch's tokens to draft: ``drafted`` tokens verified in
        all rows (0: none worth it), ``accepted`` of them."""
        self.tries.record(drafted, accepted)
        if accepted:
            self.tries.paid()

    def record_plain(self, batch: int, seconds: float) -> None:
        self.costs.record_plain(batch, seconds)

    def record_draft(self, batch: int, k: int, seconds: float) -> None:
        self._undrafted[batch] = 0
        self.costs.record_draft(batch, k, seconds)
