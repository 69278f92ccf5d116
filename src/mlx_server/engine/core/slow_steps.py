"""A log line for an engine step that took long, with where its time went.

A step is milliseconds; one of seconds is the machine building kernels for a shape it meets
for the first time (MLX's CUDA backend), a device that is busy elsewhere, or a bug. The line
splits the step into its parts (starting requests, the runner's step, saving prefixes to the
prefix cache, handing out the answers) and says what ran, so that a slow first answer can be
told apart from a wait in the queue (the ``Generation`` line's ``waited``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from mlx_server.logs import log

SLOW_STEP_S = 2.0  # where start-up turns the line on (CUDA): a step this long is logged
PARTS = ("starting requests", "the runner's step", "the prefix cache", "answers")


class StepClock:
    """Times one engine step's parts (``mark`` after each, ``running`` once the requests
    have started); ``report`` logs the step when it took ``slow_s`` or more."""

    def __init__(self, slow_s: float):
        self.slow_s = slow_s
        self._t = 0.0
        self._parts: dict[str, float] = {}
        self._what = "nothing running"

    def start(self) -> None:
        self._t = time.perf_counter()
        self._parts = {}
        self._what = "nothing running"

    def mark(self, part: str) -> None:
        now = time.perf_counter()
        self._parts[part] = self._parts.get(part, 0.0) + now - self._t
        self._t = now

    def running(self, active: Iterable[Any]) -> None:
        """What the step runs: the sequences, and how many of them still prefill (nothing
        to do where the line is off: a CPU, Metal)."""
        if self.slow_s == float("inf"):
            return
        seqs = list(active)
        prefilling = [s for s in seqs if (getattr(s, "prefill_left", 0) or 0) > 0]
        left = sum(s.prefill_left for s in prefilling)
        self._what = (
            f"{len(seqs)} running, {len(prefilling)} prefilling ({left} prompt tokens left)"
        )

    def report(self) -> str | None:
        """Log the step when slow; returns the line (None: not slow)."""
        total = sum(self._parts.values())
        if total < self.slow_s:
            return None
        parts = ", ".join(f"{p} {self._parts[p]:.2f}s" for p in PARTS if p in self._parts)
        line = f"Slow engine step: {total:.1f}s ({parts}); {self._what}"
        log(line)
        return line
