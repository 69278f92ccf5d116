"""The grammar masks of a whole batch, one call per decode step.

Per step, for the rows whose sequence has a grammar (``GrammarLogitsProcessor``): each
matcher consumes the token its row sampled last, every mask is filled into one batch
bitmask, and the masks are applied to the batch's logits in one MLX operation. With
several CPU cores the consuming and filling (``compute``) run on a worker thread while the
engine's thread launches the step's forward pass; with one core to spare they run inline,
after the launch while the device runs the pass (hand-offs to threads that a busy machine
may not schedule soon would cost more than they save).

The masks of several rows are filled in one llguidance call (``fill_next_token_bitmask_par``),
which lets go of the interpreter lock once: a call per row lets go of it and takes it again
per row, and each time another thread running Python (the server's event loop delivering
the last step's tokens) may keep it up to the interpreter's switch interval, 5 ms. On this
2-core CPU with one such thread, 32 rows of a JSON schema took 174 ms a step one call per
row, against under 1 ms without it (``bench/constrained_fill.py --busy 0,1``). That call
runs on a thread of llguidance's own: one, or its pool of ``threads`` where the fills are
measured to cost more than ``POOL_ABOVE_S`` a step and the pool is measured faster (waking
several threads costs more than most grammars' fills, microseconds a row: on an H100's host
the pool took 4.2-4.4 ms a step for 32 rows of a JSON schema). Consuming a token holds the
lock (microseconds): the matchers consume one after another on the calling thread.

A row's failure is its own: an exception while advancing or filling one grammar is
recorded on that row's owner (its sequence's ``fault``, as ``sampling.guard_processor``
does for per-row processors) and the row's logits pass through; the engine then ends that
sequence alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, TypeVar

import llguidance
import llguidance.numpy
import mlx.core as mx
import numpy as np

from mlx_server.engine.core.cpus import usable_cpus
from mlx_server.engine.grammar import mask_bits
from mlx_server.engine.grammar.mask_bits import (
    apply_bitmask,
    eos_words,
    fit_words,
    unpack,
    words_for,
)
from mlx_server.engine.grammar.processor import GrammarLogitsProcessor

_T = TypeVar("_T")


class _Faultable(Protocol):
    fault: str | None


@dataclass(eq=False)
class BatchGrammar:
    """One row's grammar and where its failure is recorded (None: raise it)."""

    processor: GrammarLogitsProcessor
    owner: _Faultable | None = None

    def blame(self, e: Exception) -> None:
        if self.owner is None:
            raise e
        if self.owner.fault is None:
            self.owner.fault = f"logits processing failed: {type(e).__name__}: {e}"

    @property
    def failed(self) -> bool:
        return self.owner is not None and self.owner.fault is not None


POOL_ABOVE_S = 0.002  # a step's matchers, run one by one, above this: the pool is tried
PROBE_EVERY = 64  # steps between two runs of the way not chosen (is it still slower?)


def default_threads() -> int:
    """llguidance's own default: 80 % of the CPUs this process may use, at most 32."""
    return max(1, min(32, usable_cpus() * 80 // 100))


@dataclass(eq=False)
class MaskPlan:
    """One step's work: the rows whose grammar masks this step, the tokens to consume."""

    live: list[tuple[int, BatchGrammar]]
    feed: list[tuple[BatchGrammar, int]]
    words: np.ndarray | None = None  # the packed masks of ``live``, once computed


class GrammarMasks:
    """Masks a batch's logits by its rows' grammars; see the module docstring.

    ``threads``: the size of llguidance's thread pool; 1: none, and ``compute`` runs where
    it is called (never on a worker thread of this object's). ``plan`` and
    ``mask`` run on the engine's thread; ``compute`` (consuming and filling: no MLX) may
    run on another while the engine's thread launches the forward pass (``submit``).
    """

    def __init__(self, threads: int | None = None, pool_above_s: float = POOL_ABOVE_S):
        """``pool_above_s``: run the matchers on the pool when one by one they are measured
        to take longer than this a step (0: always, where there is a pool)."""
        self.threads = default_threads() if threads is None else max(1, threads)
        self._executor = llguidance.LLExecutor(self.threads) if self.threads > 1 else None
        self._single: llguidance.LLExecutor | None = None  # one thread: the fills in one call
        self._worker: ThreadPoolExecutor | None = None
        self._buffers: dict[tuple[int, int], np.ndarray] = {}
        self._pool_above_s = pool_above_s
        # a matcher's step (consume and fill), by whether it ran on the pool (a moving mean)
        self._row_s: dict[bool, float | None] = {False: None, True: None}
        self._since_probe = 0  # steps past ``pool_above_s`` since the last probe
        self.steps = 0  # steps that masked at least one row
        self.rows = 0  # rows masked, over all steps
        self.submitted = 0  # steps whose masks were filled on the worker thread
        self.pooled = 0  # steps whose matchers ran on llguidance's pool

    def apply(
        self, grammars: Sequence[BatchGrammar | None], tokens: Sequence[int], logits: mx.array
    ) -> mx.array:
        """``logits`` (rows × vocab) with each row masked by its grammar, after the grammar
        consumed ``tokens[row]`` (the token fed this step). Rows without a grammar, or whose
        grammar is not active yet, are returned unchanged."""
        plan = self.plan(grammars, tokens)
        if plan is None:
            return logits
        return self.mask(self.compute(plan, logits.shape[-1]), logits)

    def plan(
        self, grammars: Sequence[BatchGrammar | None], tokens: Sequence[int]
    ) -> MaskPlan | None:
        """Show each row's token to its grammar; None when no row is masked this step."""
        live, feed = self._advance(grammars, tokens)
        return MaskPlan(live, feed) if live else None

    def compute(self, plan: MaskPlan, vocab: int) -> MaskPlan:
        """Consume the plan's tokens and fill its masks (covering ``vocab``)."""
        rows = max(len(plan.feed), len(plan.live))
        pool = self._pool_now(rows)
        t0 = time.perf_counter()
        self._consume(plan.feed)
        plan.live = [(i, g) for i, g in plan.live if not g.failed]
        plan.words = self._masks(plan.live, vocab, pool) if plan.live else None
        if rows:
            row_s = (time.perf_counter() - t0) / rows
            old = self._row_s[pool]
            self._row_s[pool] = row_s if old is None else 0.7 * old + 0.3 * row_s
        return plan

    def _pool_now(self, rows: int) -> bool:
        """Whether this step's matchers run on the pool: one by one while that is measured
        to take at most ``pool_above_s`` at this many rows (and before any measure); past
        it, whichever of the two was measured faster a row, the pool tried once first.
        Every ``PROBE_EVERY`` steps past it the other way runs, to measure it again."""
        if self._executor is None or rows < 2:
            return False
        alone, pooled = self._row_s[False], self._row_s[True]
        if self._pool_above_s > 0:
            if alone is None or alone * rows <= self._pool_above_s:
                return False
            choice = pooled is None or pooled < alone
            self._since_probe += 1
            if self._since_probe > PROBE_EVERY:
                self._since_probe = 0
                choice = not choice
        else:
            choice = True
        self.pooled += choice
        return choice

    @property
    def overlap(self) -> bool:
        """Whether ``compute`` should run on the worker thread: only with cores to spare
        (with fewer, a thread hand-off on a busy machine can cost more than the fill)."""
        return self._executor is not None

    def submit(self, plan: MaskPlan, vocab: int) -> Future[MaskPlan]:
        """``compute`` on this object's worker thread."""
        return self._on_worker(self.compute, plan, vocab)

    def submit_read(
        self,
        read: Callable[[], Sequence[int]],
        grammars: Sequence[BatchGrammar | None],
        vocab: int,
    ) -> Future[MaskPlan | None]:
        """``plan`` and ``compute`` on this object's worker thread, on the tokens ``read``
        returns there (an MLX read that waits for the device: it lets go of the interpreter
        lock meanwhile, and must touch no array the calling thread evaluates until the
        result is taken). The plan is None when no row is masked."""
        return self._on_worker(self._read_and_compute, read, grammars, vocab)

    def _read_and_compute(
        self,
        read: Callable[[], Sequence[int]],
        grammars: Sequence[BatchGrammar | None],
        vocab: int,
    ) -> MaskPlan | None:
        plan = self.plan(grammars, read())
        return None if plan is None else self.compute(plan, vocab)

    def _on_worker(self, fn: Callable[..., _T], *args: object) -> Future[_T]:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self.submitted += 1
        return self._worker.submit(fn, *args)

    def mask(self, plan: MaskPlan, logits: mx.array) -> mx.array:
        """``logits`` with the computed plan's rows masked."""
        if plan.words is None:
            return logits
        self.steps += 1
        self.rows += len(plan.live)
        if len(plan.live) == logits.shape[0]:
            return apply_bitmask(logits, plan.words)
        if mask_bits.fused():
            # one graph over the whole batch: the free rows' words are all ones
            words = np.full((logits.shape[0], plan.words.shape[1]), -1, dtype=np.int32)
            words[[i for i, _ in plan.live]] = plan.words
            return apply_bitmask(logits, words)
        allowed = unpack(plan.words, logits.shape[-1])
        rows = mx.array([i for i, _ in plan.live])
        logits[rows] = mx.where(allowed, logits[rows], -float("inf"))
        return logits

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    # ---- the grammars take their rows' tokens -------------------------------------------

    def _advance(
        self, grammars: Sequence[BatchGrammar | None], tokens: Sequence[int]
    ) -> tuple[list[tuple[int, BatchGrammar]], list[tuple[BatchGrammar, int]]]:
        """Show each row's token to its grammar: the rows whose grammar masks this step,
        and the tokens their matchers must consume first."""
        live: list[tuple[int, BatchGrammar]] = []
        feed: list[tuple[BatchGrammar, int]] = []
        for i, g in enumerate(grammars):
            if g is None or g.failed:
                continue
            try:
                token = g.processor.observe(tokens[i])
            except Exception as e:
                g.blame(e)
                continue
            if token is not None:
                live.append((i, g))
                if token >= 0:
                    feed.append((g, token))
        return live, feed

    def _consume(self, feed: list[tuple[BatchGrammar, int]]) -> None:
        # One after another on this thread: consuming holds the interpreter lock (a call
        # that let go of it would wait for it again, as the fills do).
        for g, t in feed:
            try:
                g.processor.consume(t)
            except Exception as e:
                g.blame(e)

    # ---- the masks ----------------------------------------------------------------------

    def _masks(self, live: list[tuple[int, BatchGrammar]], vocab: int, pool: bool) -> np.ndarray:
        """The packed masks of the ``live`` rows, in their order, covering ``vocab``."""
        out = np.zeros((len(live), words_for(vocab)), dtype=np.int32)
        width = live[0][1].processor.mask_words
        todo = [j for j, (_, g) in enumerate(live) if g.processor.error is None]
        if todo and all(live[j][1].processor.mask_words == width for j in todo):
            bits = self._fill([live[j][1] for j in todo], width, pool)
            out[todo] = fit_words(bits, vocab, fill=0)
        else:  # grammars of several tokenizers in one batch: each its own width
            for j in todo:
                bits = self._fill([live[j][1]], live[j][1].processor.mask_words, pool)
                out[j] = fit_words(bits, vocab, fill=0)[0]
        for j, (_, g) in enumerate(live):
            if g.processor.error is not None or not _settled(g):
                out[j] = eos_words(g.processor.eos_ids, vocab)
        return out

    def _fill(self, grammars: list[BatchGrammar], width: int, pool: bool) -> np.ndarray:
        """Each grammar's next mask, one row each (a buffer reused across steps)."""
        key = (len(grammars), width)
        buf = self._buffers.get(key)
        if buf is None:
            if len(self._buffers) > 64:
                self._buffers.clear()
            buf = self._buffers[key] = np.zeros(key, dtype=np.int32)
        if len(grammars) > 1:  # one call, the interpreter lock let go of once
            pairs = [(g.processor.matcher, j) for j, g in enumerate(grammars)]
            try:
                llguidance.numpy.fill_next_token_bitmask_par(self._executor_for(pool), pairs, buf)
                return buf
            except Exception:  # which row failed is unknown: fill them one by one
                pass
        for j, g in enumerate(grammars):
            row = buf[j]
            try:
                g.processor.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            except Exception as e:
                g.blame(e)
        return buf

    def _executor_for(self, pool: bool) -> llguidance.LLExecutor:
        """llguidance's pool where chosen, else a thread of its own that fills in turn."""
        if pool and self._executor is not None:
            return self._executor
        if self._single is None:
            self._single = llguidance.LLExecutor(1)
        return self._single


def _settled(g: BatchGrammar) -> bool:
    """The grammar is still sound after filling its mask (and its row did not fail)."""
    try:
        return not g.failed and g.processor.settle()
    except Exception as e:
        g.blame(e)
        return False
