"""The engine's warm-up: one token before serving, every batch size's shapes (a lone
request's before serving, the rest in idle time; see ``tuning.WarmUp``), the samplers'
kernels (``samplers.WARM_SETTINGS``), a lone sequence's decode step over longer key buffers
(idle time, where kernels are built per shape), and the shapes the runner adds
(``warm_shapes``: a speculative runner's verify passes)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.core as mx

from mlx_server.engine.core import faults
from mlx_server.engine.core.config import EngineConfig
from mlx_server.engine.core.tuning import (
    COLD_FIRST_TOKEN_S,
    Piece,
    ShapePieces,
    WarmUp,
    builds_kernels_on_first_use,
    first_token,
)
from mlx_server.engine.grammar import mask_bits
from mlx_server.engine.sampling.samplers import WARM_SETTINGS, reset_random_state, warm_sampler
from mlx_server.logs import log


class Warming:
    """What is left of the warm-up; ``pending`` while pieces wait for idle time."""

    def __init__(self, model: Any, config: EngineConfig, runner: Any = None, vocab: int = 0):
        self._model = model
        self._vocab = vocab  # the logits' width (the samplers' pieces; 0: none)
        self._config = config
        self._runner = runner
        self._plan: WarmUp | None = None
        # the model's logits dtype, once the first token has run (a sampler's check runs in
        # it: on CUDA each dtype builds its own kernels, seconds each on a fresh machine)
        self.logits_dtype: Any = None
        # the engine said it was ready before its first token was (``before_serving``)
        self.ready_early = False
        # host work for idle time after the plan's pieces (``when_idle``)
        self._idle: list[tuple[str, Callable[[], object]]] = []

    @property
    def pending(self) -> bool:
        return self._plan is not None or bool(self._idle)

    def when_idle(self, what: str, piece: Callable[[], object]) -> None:
        """Run ``piece`` in idle time once the warm-up's own pieces are done: host work a
        first request would otherwise wait for (structured output's tokenizer, say). Its
        failure is logged; serving goes on (the first use does it again)."""
        self._idle.append((what, piece))

    def before_serving(self, budget: float, ready: Callable[[], None] | None = None) -> str:
        """Warm up as far as ``budget`` seconds allow (unbounded: all of it); returns why
        the model cannot serve ("" when it can). ``ready``: called from a timer thread if
        the first token takes longer than ``ready_after_s`` (the engine says it is ready
        then; the rest of the warm-up waits for idle time)."""
        cfg = self._config
        first_s = 0.0
        if cfg.first_token:
            timer = None
            if ready is not None and cfg.ready_after_s != float("inf") and budget != float("inf"):
                timer = threading.Timer(cfg.ready_after_s, self._ready_early, (ready,))
                timer.daemon = True
                timer.start()
            t0 = time.perf_counter()
            try:
                self.logits_dtype = first_token(self._model)
            except Exception as e:
                error = f"the model could not compute a token: {faults.describe(e)}"
                log(f"Warm-up failed: {error}")
                return error
            finally:
                if timer is not None:  # and a call under way is over (``ready_early`` set)
                    timer.cancel()
                    timer.join()
            first_s = time.perf_counter() - t0
        # kernels being built now (an empty kernel cache): the readiness line does not wait
        # for the rest (unless every rank must run it all before serving); nor once it has
        # been said (requests may be waiting)
        cold = builds_kernels_on_first_use() and first_s >= COLD_FIRST_TOKEN_S
        cold = (cold and budget != float("inf")) or self.ready_early
        if cfg.warm_up:
            try:
                n, step, buckets = cfg.max_batch_size, cfg.prefill_step_size, cfg.prefill_buckets
                shapes = self._shapes(n)
                lone = cfg.lone_decode_keys if cfg.solo else 0
                plan = WarmUp(
                    self._model,
                    n,
                    step,
                    budget,
                    buckets=buckets,
                    shapes=shapes,
                    lone_keys=lone,
                    solo=cfg.solo,
                    samplers=self._samplers(),
                    cold=cold,
                    building_s=COLD_FIRST_TOKEN_S if builds_kernels_on_first_use() else None,
                )
                secs = plan.before_ready()
                if budget == float("inf"):  # ranks in lockstep: every rank, every piece, now
                    while plan.pending:
                        secs += plan.step()
                log(_cold_line(plan, first_s) if cold else _line(plan, n, buckets, shapes, secs))
                self._plan = plan if plan.pending else None
            except Exception as e:  # serving without it is slower at first, not wrong
                log(f"Warm-up failed: {faults.describe(e)}")
        return ""

    def _ready_early(self, ready: Callable[[], None]) -> None:
        """The first token is still being computed ``ready_after_s`` into it: kernels are
        being built (an empty kernel cache), which a first request would wait for whatever
        the readiness line said; the line does not wait for them."""
        self.ready_early = True
        log(
            f"Warm-up: the first token is still being computed after "
            f"{self._config.ready_after_s:.1f}s (kernels built on first use: an empty kernel "
            "cache); serving now, a first request waits for it"
        )
        ready()

    def _samplers(self) -> list[Piece]:
        """The samplers' pieces (``WARM_SETTINGS``), in the logits' dtype, and the compiled
        grammar mask's where it runs (a GPU)."""
        if not self._vocab:
            return []
        dtype = self.logits_dtype or mx.float32
        pieces: list[Piece] = [
            partial(warm_sampler, p, ban, self._vocab, dtype) for p, ban in WARM_SETTINGS
        ]
        if mask_bits.fused():
            pieces.append(partial(mask_bits.warm_mask, self._vocab, dtype))
        return pieces

    def _shapes(self, max_batch_size: int) -> ShapePieces | None:
        """What the runner adds to the warm-up (a runner without ``warm_shapes``: nothing)."""
        shapes = getattr(self._runner, "warm_shapes", None)
        return shapes(max_batch_size) if shapes is not None else None

    def close(self) -> None:
        """Drop what is left (a drain under way gives its generator back)."""
        if self._plan is not None:
            self._plan.close()
            self._plan = None
        self._idle.clear()

    def later(self) -> None:
        """One piece of the warm-up left for idle time."""
        plan = self._plan
        if plan is None:
            if self._idle:
                self._run_idle(*self._idle.pop(0))
            return
        try:
            secs = plan.step()
            if secs >= self._config.slow_step_s:  # on CUDA: a kernel build a request waits for
                log(
                    f"Slow warm-up piece: {secs:.1f}s in idle time ({plan.last}); a request "
                    "that came meanwhile waited for it"
                )
        except Exception as e:  # serving goes on; shapes not warmed are built on first use
            log(f"Warm-up failed: {faults.describe(e)}")
            reset_random_state()
            self._plan = None
            return
        if not plan.pending:
            self._plan = None
            log(f"Warm-up: done while idle ({plan.spent:.1f}s in all)")

    def _run_idle(self, what: str, piece: Callable[[], object]) -> None:
        t0 = time.perf_counter()
        try:
            piece()
        except Exception as e:
            log(f"Idle-time preparation of {what} failed: {faults.describe(e)}")
            return
        log(f"Idle time: {what} ready in {time.perf_counter() - t0:.2f}s")


def _cold_line(plan: WarmUp, first_s: float) -> str:
    """The start-up's warm-up line when kernels are being built (``COLD_FIRST_TOKEN_S``)."""
    return (
        f"Warm-up: the first token in {first_s:.1f}s (kernels built on first use: an empty "
        f"kernel cache); left for idle time: all {plan.queued} pieces, what a first "
        "request meets first"
    )


def _line(plan: WarmUp, n: int, buckets: bool, shapes: ShapePieces | None, secs: float) -> str:
    """The start-up's warm-up line: what ran before serving, and what was left for idle time."""
    what = ", the prefill buckets" if buckets else ""
    idle: list[str] = []
    if plan.deferred_buckets and plan.pending:
        idle.append(f"{plan.deferred_buckets} of the prefill buckets")
    if plan.samplers:
        what += ", the samplers"
        if plan.deferred_samplers and plan.pending:
            idle.append(f"{plan.deferred_samplers} of the {plan.samplers} samplers")
    if shapes is not None and shapes.what:
        what += f", {shapes.what}"
        if plan.deferred:
            idle.append(f"{plan.deferred} of the {len(shapes.first)} {shapes.what}")
    first = 1 if plan.batch1_deferred else 2
    if plan.pending and n >= first:
        idle.append(f"batch sizes {first}-{n}")
    if plan.pending and plan.lone_lengths:
        idle.append(f"a lone decode step over {plan.lone_lengths[0]}-{plan.lone_lengths[-1]} keys")
    sizes = "1" if plan.pending else f"1-{n}"
    head = f"batch sizes {sizes}{what}" if not plan.batch1_deferred else what.lstrip(", ")
    later = f"; left for idle time: {', '.join(idle)}" if idle else ""
    if plan.building and idle:
        later += " (kernels being built: a piece took seconds, the kernel cache lacks them)"
    return f"Warm-up: {head} in {secs:.1f}s{later}"
