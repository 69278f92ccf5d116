"""Shadow drafts: a cheap drafter asked on plain steps, its proposal scored against the
tokens plain decoding then emits, never verified (see ``controller``)."""

from __future__ import annotations

from mlx_server.engine.speculative.controller import Acceptance
from mlx_server.engine.speculative.plan_log import PlanLog


class Shadow:
    """A draft proposed on a plain step and scored against the tokens that follow. After
    one that missed at once (or none), the next waits 1, then 3, then ``REST`` steps:
    with nothing to accept the drafter is asked on one plain step in eight."""

    REST = 7

    def __init__(self) -> None:
        self.draft: list[int] = []
        self.hits = 0
        self._rest = 0  # plain steps to let pass before the next shadow draft
        self._gap = 0

    @property
    def open(self) -> bool:
        return bool(self.draft)

    def due(self) -> bool:
        """Whether to ask the drafter at this step (none is open)."""
        if self._rest > 0:
            self._rest -= 1
            return False
        return True

    def start(self, draft: list[int], acc: Acceptance) -> None:
        """Score ``draft`` from the next emitted token on. An empty one leaves the rate as
        it is (nothing was proposed, so nothing was wrong) and waits as a miss does."""
        self.draft, self.hits = list(draft), 0
        if not draft:
            self._missed()

    def _missed(self) -> None:
        self._gap = min(2 * self._gap + 1, self.REST)
        self._rest = self._gap

    def score(self, token: int, acc: Acceptance, log: PlanLog | None) -> None:
        """The next emitted token: a hit, or the end of the draft's run. Each moves the
        rate at once, as a verified position would."""
        d = self.draft
        if not d:
            return
        hit = d[self.hits] == token
        acc.observe(1, int(hit))
        self.hits += hit
        if hit and self.hits < len(d):
            return
        if log is not None:
            log.shadowed(self.hits + (not hit), self.hits)
        if self.hits:
            self._gap = 0
        else:
            self._missed()
        self.draft, self.hits = [], 0

    def drop(self) -> None:
        self.draft, self.hits = [], 0
