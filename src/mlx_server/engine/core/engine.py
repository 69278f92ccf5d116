"""The engine: one thread owns MLX, a scheduler decides what runs, a runner computes it.

The pieces (each its own module):

- ``scheduler.Scheduler``: the queue, admission against the batch size and the KV budget,
  fairness between long and short prompts;
- a runner (``runners.base.Runner``: insert, step, remove, extract state), built by
  start-up and handed in: the lone-request runner in front of mlx-lm's ``BatchGenerator``
  (``runners.assembly.text_runner``), each speculative (``speculative.assembly``), or the
  vision runner (``runners.vision.vision_runner``);
- ``delivery``: tokens to text, stop strings, logprobs and the ``Finished`` event;
- ``endings``: sequences leaving (finished, stopped, cancelled, faulted, all at shutdown);
- ``faults``: who a failure belongs to;
- ``prefixes``: the engine's side of the prefix cache (``prefix_cache.PrefixCache``):
  finished, stopped and cancelled sequences leave their KV state there, and a prompt's
  system-prompt prefix is saved as it is prefilled, so a later prompt sharing a prefix
  prefills only the rest;
- ``warming``: the warm-up before serving and in idle time;
- ``slow_steps``: a log line for a step that took seconds, with where its time went;
- ``owner``: the thread that owns MLX, its loop, and the calls other threads hand it.

The engine itself is the thread's loop and the hand-offs between these; several models in
one process are several engines.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from mlx_server.engine.cache.prefix import PrefixCache
from mlx_server.engine.core import assembly, faults, wired
from mlx_server.engine.core.config import EngineConfig
from mlx_server.engine.core.delivery import Seq
from mlx_server.engine.core.endings import Endings
from mlx_server.engine.core.handle import GenerationHandle, Outbox, Started
from mlx_server.engine.core.owner import OwnerThread
from mlx_server.engine.core.prefixes import Prefixes
from mlx_server.engine.core.protocol import GenerationObserver
from mlx_server.engine.core.slow_steps import PARTS, StepClock
from mlx_server.engine.core.warming import Warming
from mlx_server.engine.runners.base import Insert, Runner
from mlx_server.engine.sampling.samplers import SamplerPool, sequence_sampling
from mlx_server.errors import ModelUnavailable
from mlx_server.logs import log
from mlx_server.types import GenerationRequest

__all__ = ["Engine", "EngineConfig"]


class Engine(OwnerThread):
    """Generation over one model, usable without HTTP; see the module docstring."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        config: EngineConfig | None = None,
        *,
        runner: Runner,
        observer: GenerationObserver | None = None,
    ):
        """``runner``: what computes the steps, built by start-up (``runners.assembly``,
        ``speculative.assembly``, ``runners.vision``); ``observer``: watches every
        generation (the metrics)."""
        self.observer = observer
        self.model = model
        self.tokenizer = tokenizer
        self.config = cfg = config or EngineConfig()
        self.eos_ids = sorted(int(t) for t in tokenizer.eos_token_ids)
        self._prompt_cache = assembly.prefix_cache(cfg)
        self._sched = assembly.scheduler(cfg, self._prompt_cache)
        self._runner: Runner = runner
        if cfg.lockstep is not None:
            self._runner = cfg.lockstep.lead(self._runner, self._prompt_cache, cfg)
        self._prefixes = Prefixes(self._prompt_cache, self._runner, model, cfg.checkpoint_every)
        self._prefixes.watch_reads(self._sched.wake)
        # Width of the model's logits, to try each request's sampler before it runs.
        args = getattr(model, "args", None)
        self._vocab = int(getattr(args, "vocab_size", 0) or len(tokenizer.vocab))
        self._samplers = SamplerPool()
        self._outbox = Outbox()  # events of one step, one wake-up per step
        OwnerThread.__init__(self, "mlx-engine", self._sched.wake, lambda: self._sched.stopping)
        self.start_error = ""  # why the model cannot serve (set before wait_ready returns)
        self._end = Endings(tokenizer, self._sched, self._runner, self._prefixes, self._outbox)
        # the warm-up, and its pieces left for idle time
        self._warming = Warming(model, cfg, runner, self._vocab)
        self._busy_at = float("-inf")  # when the engine thread last saw work (monotonic)
        self._wired = 0  # bytes claimed of the process's wired limit (wired.py)
        self._clock = StepClock(cfg.slow_step_s)  # a slow step's parts, for the log

    # ---- public API (any thread) -------------------------------------------------------

    def start(self) -> None:
        wired.claim(self.config.wired_bytes)
        self._wired = self.config.wired_bytes
        super().start()

    def submit(
        self, req: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None
    ) -> GenerationHandle:
        """Queue a request; raises Overloaded when shutting down or the queue is full, and
        InvalidRequest for one that can never fit the KV budget, ModelUnavailable once the
        model's first token failed after the engine said it was ready."""
        if self.start_error:  # its first token failed after the readiness line
            raise ModelUnavailable(f"the model cannot serve: {self.start_error}")
        loop = loop or asyncio.get_running_loop()
        observe = self.observer.generation() if self.observer is not None else None
        handle = GenerationHandle(
            req.request_id, loop, self._outbox, coalesce=True, observe=observe
        )
        self._sched.queue(req, handle)
        return handle

    def expect(self, request_id: str) -> Callable[[], None]:
        """Announce a request whose prompt is being built, so that requests arriving together
        start together (see ``scheduler``); returns what to call once it was submitted or
        will not be (a no-op after ``submit``). From any thread."""
        self._sched.expect(request_id)
        return lambda: self._sched.withdraw(request_id)

    def cancel(self, request_id: str | None = None) -> int:
        """Cancel one request by id, or every queued and running one. Returns how many."""
        return self._sched.cancel(request_id)

    def when_idle(self, what: str, piece: Callable[[], object]) -> None:
        """Host work for idle time after the warm-up (``Warming.when_idle``). From any
        thread."""
        self._warming.when_idle(what, piece)

    @property
    def warming_up(self) -> bool:
        """Whether warm-up pieces are left for idle time (benchmarks wait for them)."""
        return self._warming.pending

    @property
    def active_count(self) -> int:
        return len(self._sched.active)

    @property
    def queue_depth(self) -> int:
        return len(self._sched.pending)

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The prefix cache (owned by the engine thread: read it only while idle)."""
        return self._prompt_cache

    def stats(self) -> dict[str, Any]:
        """Counters for monitoring; safe to call from any thread."""
        cache = self._prompt_cache
        return {
            **self._sched.stats(),
            **(cache.stats() if cache is not None else {"prompt_cache_entries": 0}),
            **self._runner.stats(),
        }

    def shutdown(self, timeout: float = 3.0) -> None:
        """Cancel everything, stop the thread and wait for it (bounded)."""
        super().shutdown(timeout)
        wired.release(self._wired)
        self._wired = 0

    # ---- engine thread: the loop -------------------------------------------------------

    # The loop itself is ``OwnerThread._run``: ``_prepare``, then ``_work`` while
    # ``_wait_for_work``, then ``_stopped``.

    def _prepare(self) -> None:
        self._warm_up()

    def _work(self) -> None:
        clock = self._clock
        clock.start()
        try:
            self._end.cancelled()
            self._admit()
            clock.mark(PARTS[0])
            if self._sched.active:
                clock.running(self._sched.active.values())
                self._step()
            if not self._sched.active:  # idle next: the disk tier's saves to its writer now
                self._prefixes.settle(everything=True)
        except Exception as e:
            if self.config.lockstep is not None:
                self.config.lockstep.broken(e)  # the ranks no longer agree: stop
            # A fault no single sequence could be blamed for: end the running ones,
            # start the runner over; queued requests keep their place.
            self._end.fail(faults.step_failed(e), queued=False)
            self._runner.reset()
        self._outbox.flush()
        clock.report()

    def _stop(self) -> None:
        self._sched.stop()

    def _stopped(self) -> None:
        self._end.fail("cancelled", queued=True)
        self._warming.close()  # a drain under way gives its generator back
        self._runner.close()
        self._prefixes.close()

    def _wait_for_work(self) -> bool:
        """Sleep until there is something to do; False once stopping and nothing runs."""
        sched = self._sched
        while True:
            with sched.wake:
                if sched.stopping or sched.active or self._calls:
                    self._busy_at = time.monotonic()
                    return not (sched.stopping and not sched.active and not sched.pending)
                hold = sched.gather_left() if sched.pending else 0.5
                if sched.pending:
                    self._busy_at = time.monotonic()
                if not hold:  # queued requests that need not wait for others
                    return True
                warm = self._warming.pending and not sched.pending
                if warm:  # a piece only once idle for a while, never with work queued
                    rest = self._busy_at + self.config.warm_idle_s - time.monotonic()
                    warm, hold = rest <= 0, min(hold, max(rest, 0.0))
                if not warm:
                    sched.wake.wait(hold)
            if warm:  # idle: the next piece of the warm-up, outside the lock
                self._warming.later()
                continue
            if self.config.lockstep is not None:
                self.config.lockstep.idle()  # the other ranks hear from rank 0 while idle

    def _warm_up(self) -> None:
        """Warm up before serving (see ``warming``), then say the engine is ready (earlier
        where the first token outlasts ``ready_after_s``: then a failure of it refuses
        every request from then on, with the reason)."""
        error = self._warming.before_serving(self._warm_up_budget(), self._ready.set)
        self.start_error = error  # requests are refused from here (``submit``)
        if error and self._ready.is_set():  # the readiness line may be out already
            log(f"The model cannot serve: {error}; every request is refused with it")
            self._end.fail(f"the model cannot serve: {error}", queued=True)
        # Idle time counts from readiness: a client's first request, sent on the readiness
        # line, finds no warm-up piece under way (on a fresh CUDA machine one can take
        # seconds; a VLM's probe waited 45 s behind them on an H100).
        self._busy_at = time.monotonic()
        self._ready.set()

    def _warm_up_budget(self) -> float:
        """Seconds the warm-up may take; ranks in lockstep all run every warm-up step (an
        unbounded budget: all of it before serving, none left for idle time)."""
        return 30.0 if self.config.lockstep is None else float("inf")

    # ---- engine thread: starting sequences ---------------------------------------------

    def _admit(self) -> None:
        """Start queued requests, in the scheduler's order, while it lets them."""
        finish = self._end.finish
        while (seq := self._sched.next_admissible(lambda s: finish(s, "cancelled"))) is not None:
            try:
                self._start(seq)
            except Exception as e:  # this request's own fault (e.g. its sampler): its error
                seq.uid = -1
                finish(seq, "error", error=faults.start_failed(seq, e))
        # With nothing to run but a disk read in flight, wait for it instead of spinning.
        sched = self._sched
        with sched.wake:
            if not sched.active and not self._calls and self._prefixes.reading:
                sched.wake.wait(0.05)

    def _start(self, seq: Seq) -> None:
        req, prefixes = seq.req, self._prefixes
        sampler, processors = sequence_sampling(
            seq, req, self._samplers, self._vocab, self.eos_ids, self._warming.logits_dtype
        )
        prompt = list(req.prompt_tokens)
        cache, rest = prefixes.fetch(req)
        seq.started = Started(len(prompt) - len(rest))
        seq.prefill_left = len(rest)
        seq.handle.push(seq.started)
        cached = seq.started.cached_tokens
        seq.system_end = prefixes.system_end(seq, prompt)
        job = Insert(
            uid=self._sched.next_uid(),
            request=req,
            prompt=prompt,
            cached=cached,
            cache=cache,
            sampler=sampler,
            processors=processors,
            system_end=seq.system_end,
            alone=self.config.solo and self._sched.is_alone(),
            checkpoints=prefixes.checkpoints_of(req, cached),
        )
        seq.uid = job.uid
        self._runner.insert(job)
        seq.begin_output(self.tokenizer)
        self._sched.run(seq)

    # ---- engine thread: stepping -------------------------------------------------------

    def _step(self) -> None:
        self._prefixes.settle()
        progress, responses = self._runner.step()
        self._clock.mark(PARTS[1])
        active = self._sched.active
        faults.blame_shared_samplers(active.values())
        for p in progress:
            seq = active.get(p.uid)
            if seq is None:
                continue
            if p.error is not None:  # its own failure: it ends alone (``Endings.faulted``)
                seq.fault = seq.fault or p.error
                continue
            done_n, total = p.progress
            seq.prefill_left = total - done_n
        self._prefixes.save(progress, active)
        self._clock.mark(PARTS[2])
        self._end.responses(responses)
        self._clock.mark(PARTS[3])
