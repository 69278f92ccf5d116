"""The speculation plan's decisions, counted, for benchmarks and the log.

Each step a controller decides (``DraftLength`` for a lone sequence, ``BatchPlan`` for a
batch) is counted under its reason; each verifying step adds what it drafted, accepted and
cost; each time drafting stops, the reason and the figures behind it are kept (the last
``KEEP``). ``StepCosts`` objects the controllers use are registered so the measured
verify costs can be printed beside the decisions. ``trace``, when set, is called with one
line per verifying step as it starts (a log that survives a crash in the pass itself) and
one when it ends, with its phases' milliseconds (``phases``).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import mlx.core as mx

KEEP = 64

# Why a step drafts, or does not.
DRAFTS = "drafts: expected to pay"
PROBE = "drafts: a probe after backing off"
EXPLORE = "drafts: measuring an unmeasured cost"
MEASURING = "plain: measuring the plain step"
RATE = "plain: drafts are not accepted enough to pay even for free"
COST = "plain: verifying costs more than the accepted drafts yield"
BACKING_OFF = "plain: backing off after failed tries"
PAUSED = "plain: paused after a try with nothing to propose"
NO_DRAFT = "plain: the drafter had nothing"
LAST = "plain: at the token limit"


class PlanLog:
    """Counters of the plan's decisions and results; see the module docstring."""

    def __init__(self, trace: Callable[[str], None] | None = None) -> None:
        self.steps: Counter[str] = Counter()  # decisions by reason (a batch step counts once)
        self.drafted = 0
        self.accepted = 0
        self.verify_steps = 0
        self.verify_seconds = 0.0
        self.shadow_drafted = 0  # drafts scored against plain decoding, not verified
        self.shadow_accepted = 0
        self.stops: deque[str] = deque(maxlen=KEEP)
        self.stop_count = 0
        self.costs: list[Any] = []  # StepCosts
        self.trace = trace
        # a lone sequence's passes queued behind the one being read, and of those dropped
        # (the pass before was not accepted whole; ``sequence.SpeculativeSequence``)
        self.queued = 0
        self.dropped = 0

    def decided(self, reason: str) -> None:
        self.steps[reason] += 1

    def verifying(self, batch: int, width: int, lengths: list[int]) -> None:
        if self.trace is not None:
            self.trace(f"verify batch={batch} width={width} drafts={lengths}")

    def phases(self, seconds: float, timings: dict[str, float]) -> None:
        """The verifying step's time and its phases' (each evaluated alone), traced."""
        if self.trace is not None:
            parts = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in timings.items())
            rest = seconds - sum(timings.values())  # drafting, choosing, answering
            self.trace(f"  verified in {seconds * 1e3:.2f} ms: {parts}, other {rest * 1e3:.2f}")

    def verified(self, drafted: int, accepted: int, seconds: float) -> None:
        self.verify_steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.verify_seconds += seconds

    def shadowed(self, drafted: int, accepted: int) -> None:
        self.shadow_drafted += drafted
        self.shadow_accepted += accepted

    def stopped(self, why: str) -> None:
        self.stops.append(why)
        self.stop_count += 1

    def watch(self, costs: Any) -> None:
        if all(c is not costs for c in self.costs):
            self.costs.append(costs)

    def summary(self) -> str:
        """A few lines: decisions by reason, drafts, the measured cost table, stops."""
        lines = [
            "plan: "
            + ", ".join(f"{n} x {why}" for why, n in self.steps.most_common())
            + f"; {self.verify_steps} verifying steps drafted {self.drafted}, "
            f"accepted {self.accepted}; shadow drafts (scored, not verified) "
            f"{self.shadow_drafted}, accepted {self.shadow_accepted}"
        ]
        if self.queued:
            lines.append(
                f"  passes queued behind the one read: {self.queued}, dropped {self.dropped}"
            )
        for c in self.costs:
            for b, row in c.table().items():
                t0 = c.t0.get(b, 0.0)
                cells = ", ".join(f"w={w}: {r:.2f}" for w, r in row.items())
                lines.append(
                    f"  verify cost / plain step ({t0 * 1e3:.2f} ms) at batch {b}: {cells}"
                )
            if c.builds:
                lines.append(f"  samples left out as kernel builds: {c.builds}")
        if self.stops:
            whys = Counter(s.split(" (")[0] for s in self.stops)
            lines.append(
                f"  drafting stopped {self.stop_count} time(s), the last {len(self.stops)}: "
                + ", ".join(f"{n} x {w}" for w, n in whys.most_common())
            )
            lines.append(f"  last stop: {self.stops[-1]}")
        return "\n".join(lines)


class PhaseClock:
    """Seconds of each phase of a verifying step, each evaluated before the next starts
    (``done``); with no ``timings`` to fill, it evaluates nothing early."""

    def __init__(self, timings: dict[str, float] | None):
        self.timings = timings
        self.t = time.perf_counter()

    def done(self, name: str, result: Any = None) -> None:
        if self.timings is None:
            return
        if result is not None:
            mx.eval(result)
        now = time.perf_counter()
        self.timings[name] = now - self.t
        self.t = now
