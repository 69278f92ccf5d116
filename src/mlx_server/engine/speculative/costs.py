"""What a verifying step costs, measured, and the draft length that pays most for it.

A verify pass runs over ``w + 1`` positions per row, where ``w`` is a *width*: a power of
two up to the longest draft (``widths``), a shorter draft padded to the next one
(``bucket``). So the passes take a handful of shapes that repeat: each shape is compiled
(and, on CUDA, captured as a graph) once, and each has its own measured cost. That cost
is not linear in ``w``: on a GPU a pass over 9 tokens costs 1.6-2.7 plain steps where
memory bandwidth alone says about one, because the step is not pipelined (its tokens are
read before the next is queued) and a new shape pays for its first compilation. So
``StepCosts`` keeps seconds per (batch size, width), measured, its first sample of each
dropped (that one compiles). Where kernels are built per shape (CUDA) a build costs a
third of a second to a minute against a pass of a few milliseconds, and it may come later
than a shape's first pass (a prefill's shapes in between, a batch size met again), so a
sample more than ``BUILD`` times its estimate (or, before one, than ``BUILD`` plain steps
per position) is taken for a build and left out; two such in a row count (the cost has
changed), and a sample ``BUILD`` times below the estimate replaces it (a build had got
in: building only ever slows a step). Plain steps are kept the same way. The estimate is
the median of the last ``WINDOW`` samples kept: on the H100 the demo model's first verify
passes took 21-23 ms and the next ones 8-9 ms, with a 27 ms one now and then, and an
average that began at 21 ms still said 12 ms after a dozen passes, so the plan stopped
drafting on a code edit whose drafts were 99 % accepted. A width never costs more than a
wider one measured at the same batch size: a narrow width whose few samples were all
early and dear is not left dear for good because the plan, believing them, never tries it
again, and where a narrow width is measured dearer than a wider one (kernels are not
monotonic in the rows they take) its drafts are padded to the wider one (``width``). It
answers for a width not yet measured by interpolating between the plain step (width 0)
and the widths measured, past them by the slope between the two widest (at most
``GUESS`` per position), or from ``GUESS`` before any measure.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from statistics import median
from typing import Any

WINDOW = 5  # samples kept per estimate (their median)
MARGIN = 1.02  # drafting must beat plain decoding by this much: noise should not make it draft
GUESS = 0.15  # before any measure: each drafted position costs this much of a plain step
BUILD = 4.0  # a sample this many times its estimate is a kernel build, not the step's cost
CHEAPER = 0.8  # a wider pass measured at most this share of a draft's own width's is run instead


def widths(max_k: int) -> list[int]:
    """The pass widths for drafts of up to ``max_k`` tokens: 1, 2, 4, ... and ``max_k``."""
    out, w = [], 1
    while w < max_k:
        out.append(w)
        w *= 2
    return [*out, max_k] if max_k > 0 else []


def bucket(n: int, max_k: int) -> int:
    """The width a draft of ``n`` tokens (1 to ``max_k``) is padded to."""
    return next(w for w in widths(max_k) if w >= n)


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a step yields with a draft of ``k`` at per-token acceptance ``rate``."""
    a = min(max(rate, 0.0), 0.999)
    return (1 - a ** (k + 1)) / (1 - a)


class StepCosts:
    """Measured step seconds by batch size: ``t0`` without a draft, ``verify`` for a pass
    of each width of drafts up to ``max_k`` (see the module docstring)."""

    def __init__(self, max_k: int) -> None:
        self.max_k = max_k
        self.widths = widths(max_k)
        self.t0: dict[int, float] = {}
        self.verify: dict[tuple[int, int], float] = {}
        self.samples: dict[tuple[int, int], int] = {}  # verify passes seen, the dropped one too
        self.plain_samples: dict[int, int] = {}
        self.builds = 0  # samples left out as kernel builds
        self._outlier: set[Any] = set()  # keys whose last sample was left out
        self._recent: dict[Any, deque[float]] = {}  # the samples kept, by table and key

    def measured(self, batch: int) -> bool:
        """Whether the plain step at ``batch`` rows has been timed twice (one may be an
        outlier: the first after a prefill, a new shape)."""
        return self.plain_samples.get(batch, 0) >= 2

    def record_plain(self, batch: int, seconds: float) -> None:
        self.plain_samples[batch] = self.plain_samples.get(batch, 0) + 1
        self._update(self.t0, batch, seconds, None)

    def record_verify(self, batch: int, width: int, seconds: float) -> None:
        key = (batch, width)
        n = self.samples[key] = self.samples.get(key, 0) + 1
        if n == 1:
            return  # the shape's first pass compiles: not what the next ones cost
        t0 = self.t0.get(batch)
        self._update(self.verify, key, seconds, t0 * (width + 1) if t0 else None)

    def _update(
        self, table: dict[Any, float], key: Any, seconds: float, bound: float | None
    ) -> None:
        """Average ``seconds`` into ``table[key]``, leaving out a build (see the module
        docstring); ``bound``: what a step may cost before any estimate (None: anything)."""
        old = table.get(key, bound)
        if old is not None and seconds > BUILD * old and key not in self._outlier:
            self._outlier.add(key)  # a build, unless the next sample is as dear
            self.builds += 1
            return
        self._outlier.discard(key)
        old = table.get(key)
        recent = self._recent.setdefault((id(table), key), deque(maxlen=WINDOW))
        if old is None or seconds > BUILD * old or seconds * BUILD < old:
            recent.clear()  # the first, a changed cost, or a build that got in
        recent.append(seconds)
        table[key] = median(recent)

    def width(self, batch: int, n: int) -> int:
        """The width a draft of ``n`` (1 to ``max_k``) is padded to at ``batch`` rows: its
        ``bucket``, or a wider width measured to cost at most ``CHEAPER`` of it, the
        cheapest such. Kernels are not monotonic in the rows they take: on an H200 a 4-bit
        8B alone ran a pass over 7 rows in 4.53 decode steps and one over 9 rows in 2.58
        (``bench/results/gpu-2026-12-06f-speculative-8b-4-d-h200.txt``); so
        ``cost`` says no width costs more than a wider one measured, and the passes are
        padded to make that so."""
        own = bucket(n, self.max_k)
        best, best_s = own, self.verify.get((batch, own))
        if best_s is None:
            return own
        best_s *= CHEAPER
        for w in self.widths[self.widths.index(own) + 1 :]:
            s = self.verify.get((batch, w))
            if s is not None and s <= best_s:
                best, best_s = w, s
        return best

    def cost(self, batch: int, width: int) -> float | None:
        """Seconds of a verifying step of ``width`` at ``batch`` rows (None: no plain step
        measured at that size yet)."""
        t0 = self.t0.get(batch)
        if t0 is None:
            return None
        # A verifying step does a plain step's work and more: noise never makes it cheaper.
        return max(t0, self._estimate(batch, width, t0))

    def _estimate(self, batch: int, width: int, t0: float) -> float:
        got = self.verify.get((batch, width))
        if got is not None:
            wider = [s for (b, w), s in self.verify.items() if b == batch and w > width]
            return min([got, *wider])
        points = sorted((w, s) for (b, w), s in self.verify.items() if b == batch)
        if not points:
            return t0 * (1 + GUESS * width)
        lo_w, lo_s = 0, t0
        for w, s in points:
            if w > width:  # between two measured widths (or the plain step and one)
                return lo_s + (s - lo_s) * (width - lo_w) / (w - lo_w)
            lo_w, lo_s = w, s
        # Past the widest measured: what one more position costs is known only between
        # two measured widths (from the plain step, the pass's fixed cost would count as
        # per position); at most the guess.
        slope = GUESS * t0
        if len(points) > 1:
            (w1, s1), (w2, s2) = points[-2:]
            slope = min(slope, max(0.0, (s2 - s1) / (w2 - w1)))
        return lo_s + slope * (width - lo_w)

    def best(
        self, batch: int, rates: Sequence[float], lengths: Sequence[int], free: bool = False
    ) -> int:
        """The width (0: no draft) that maximises expected tokens per second for rows with
        these acceptance rates and these drafts available (0: the row drafts nothing); each
        row drafts up to the width. ``free``: as if verifying cost no more than a plain step
        (whether acceptance alone rules drafting out)."""
        top = min(max(lengths, default=0), self.max_k)
        t0 = self.t0.get(batch)
        if top <= 0 or t0 is None or t0 <= 0:
            return 0
        # Checked every step: rule out at once rates at which no draft could pay, as no
        # row yields more than 1 / (1 - rate) tokens a step however long its draft.
        ceiling = sum(
            1 / (1 - min(r, 0.999)) if n > 0 else 1.0 for r, n in zip(rates, lengths, strict=True)
        )
        if ceiling <= len(rates) * MARGIN:
            return 0
        best, best_speed = 0, len(rates) / t0
        for w in self.widths[: self.widths.index(bucket(top, self.max_k)) + 1]:
            seconds = t0 if free else self.cost(batch, w)
            if seconds is None or seconds <= 0:
                continue
            tokens = sum(expected_tokens(r, min(w, n)) for r, n in zip(rates, lengths, strict=True))
            speed = tokens / seconds
            if speed > best_speed * MARGIN:
                best, best_speed = w, speed
        return best

    def table(self) -> dict[int, dict[int, float]]:
        """Measured verify cost over the plain step's, by batch size and width."""
        out: dict[int, dict[int, float]] = {}
        for (b, w), s in sorted(self.verify.items()):
            t0 = self.t0.get(b)
            if t0:
                out.setdefault(b, {})[w] = s / t0
        return out
