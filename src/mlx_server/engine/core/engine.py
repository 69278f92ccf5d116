"""The engine: one thread owns MLX, a scheduler decides what runs, a runner computes it.

The pieces (each its own module):

- ``scheduler.Scheduler``: the queue, admission against the batch size and the KV budget,
  fairness between long and short prompts;
- a runner (``runner.Runner``: insert, step, remove, extract state): by default the
  lone-request runner in front of mlx-lm's ``BatchGenerator`` (``solo.LoneFirstRunner``);
- ``delivery``: tokens to text, stop strings, logprobs and the ``Finished`` event;
- ``faults``: who a failure belongs to;
- the prefix cache (``prefix_cache.PrefixCache``): finished, stopped and cancelled
  sequences leave their KV state there, and a prompt's system-prompt prefix is saved as it
  is prefilled, so a later prompt sharing a prefix prefills only the rest.

The engine itself is the thread's loop and the hand-offs between these. Another runner (a
speculative decoder, the vision runner) is passed as ``runner=``; several models in one
process are several engines.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from mlx_server.engine.cache.checkpoints import CHUNK_EVERY, needs_checkpoints, pauses
from mlx_server.engine.cache.prefix import CHECKPOINT, SYSTEM, PrefixCache
from mlx_server.engine.core import faults, wired
from mlx_server.engine.core.delivery import Seq, deliver_finish, deliver_token
from mlx_server.engine.core.handle import GenerationHandle, Outbox, Started
from mlx_server.engine.core.protocol import GenerationObserver
from mlx_server.engine.core.scheduler import Scheduler
from mlx_server.engine.core.tuning import WarmUp, first_token
from mlx_server.engine.runners.base import Insert, Progress, Response, Runner
from mlx_server.engine.runners.batch import BatchRunner
from mlx_server.engine.runners.solo import LoneFirstRunner, SoloRunner
from mlx_server.engine.sampling.samplers import SamplerPool, reset_random_state, sequence_sampling
from mlx_server.errors import Overloaded
from mlx_server.logs import log
from mlx_server.types import GenerationRequest

T = TypeVar("T")


@dataclass
class EngineConfig:
    max_batch_size: int = 8
    max_queue: int = 64
    prefill_step_size: int = 512
    prompt_cache_size: int = 16
    prompt_cache_bytes: int = 2 << 30
    kv_budget_bytes: int = 4 << 30
    kv_bytes_per_token: int = 1
    kv_bytes_per_sequence: int = 0  # sliding windows and recurrent states (memory_plan)
    prompt_cache_disk: Any = None  # disk_cache.DiskPromptCache: the prefix cache's disk tier
    prompt_cache_disk_off: str = ""  # without one: why (reported by /health)
    # Run every batch size once: a lone request's shapes before serving, the rest while idle
    # (tuning.WarmUp; all before serving when ranks run in lockstep).
    warm_up: bool = False
    # Seconds the engine must have been idle before the next warm-up piece: a conversation's
    # next message, typed soon after a reply, does not land on one.
    warm_idle_s: float = 1.5
    # Compute one token before serving (tuning.first_token); a failure is ``start_error``.
    first_token: bool = False
    # Bytes this engine's model keeps resident (weights and KV budget): its share of the
    # process's wired limit while it runs (wired.py; Metal only).
    wired_bytes: int = 0
    solo: bool = True  # a lone request runs on a plain KV cache (see solo.py)
    speculation: Any = None  # speculative.runner.Speculation: requests speculate, alone or batched
    gather_s: float = 0.05  # how long queued requests wait for announced ones (Scheduler)
    prefill_buckets: bool = False  # the lone path pads prefill chunks (tuning.PREFILL_BUCKETS)
    # lockstep.leader.Lead: rank 0 of several ranks that compute each step together (the
    # model sharded across them); its runner is wrapped to journal for the other ranks.
    lockstep: Any = None
    # Tokens between the chunk-boundary checkpoints of a long prefill (cache/checkpoints.py).
    checkpoint_every: int = CHUNK_EVERY


class Engine:
    """Generation over one model, usable without HTTP; see the module docstring."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        config: EngineConfig | None = None,
        runner: Runner | None = None,
        observer: GenerationObserver | None = None,
    ):
        """``observer``: watches every generation (the metrics)."""
        self.observer = observer
        self.model = model
        self.tokenizer = tokenizer
        self.config = cfg = config or EngineConfig()
        self.eos_ids = sorted(int(t) for t in tokenizer.eos_token_ids)
        self._prompt_cache = (
            PrefixCache(
                cfg.prompt_cache_size,
                cfg.prompt_cache_bytes,
                disk=cfg.prompt_cache_disk,
                disk_off_reason=cfg.prompt_cache_disk_off,
            )
            if cfg.prompt_cache_size > 0
            else None
        )
        self._sched = Scheduler(
            max_batch_size=cfg.max_batch_size,
            max_queue=cfg.max_queue,
            prefill_step_size=cfg.prefill_step_size,
            kv_budget_bytes=cfg.kv_budget_bytes,
            kv_bytes_per_token=cfg.kv_bytes_per_token,
            kv_bytes_per_sequence=cfg.kv_bytes_per_sequence,
            prefix_cache=self._prompt_cache,
            gather_s=cfg.gather_s,
        )
        # A runner with no sequences is falsy (it has a length): test for None.
        self._runner: Runner = runner if runner is not None else self._default_runner()
        if cfg.lockstep is not None:
            self._runner = cfg.lockstep.lead(self._runner, self._prompt_cache, cfg)
        self._watch_disk_reads()
        # Keep each prompt's state before generation where a cache cannot be rewound.
        self._checkpoints = self._prompt_cache is not None and needs_checkpoints(model)
        # Width of the model's logits, to try each request's sampler before it runs.
        args = getattr(model, "args", None)
        self._vocab = int(getattr(args, "vocab_size", 0) or len(tokenizer.vocab))
        self._samplers = SamplerPool()
        self._outbox = Outbox()  # events of one step, one wake-up per step
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self.start_error = ""
        self._warming: WarmUp | None = None  # warm-up pieces left for idle time
        self._busy_at = float("-inf")  # when the engine thread last saw work (monotonic)
        self._wired = 0  # bytes claimed of the process's wired limit (wired.py)  # why the model cannot serve (set before wait_ready returns)

    def _default_runner(self) -> Runner:
        cfg = self.config
        spec = cfg.speculation
        batch: BatchRunner
        if spec is not None:  # the batch speculates too (speculative/batch.py)
            from mlx_server.engine.speculative.batch_runner import SpeculativeBatchRunner

            batch = SpeculativeBatchRunner(
                self.model,
                self.eos_ids,
                max_batch_size=cfg.max_batch_size,
                prefill_step_size=cfg.prefill_step_size,
                keep_caches=self._prompt_cache is not None,
                spec=spec,
            )
        else:
            batch = BatchRunner(
                self.model,
                self.eos_ids,
                max_batch_size=cfg.max_batch_size,
                prefill_step_size=cfg.prefill_step_size,
                keep_caches=self._prompt_cache is not None,
            )
        if not cfg.solo:
            return batch
        if spec is not None:
            from mlx_server.engine.speculative.runner import SpeculativeRunner

            lone: SoloRunner = SpeculativeRunner(
                self.model,
                self.eos_ids,
                prefill_step_size=cfg.prefill_step_size,
                prefill_buckets=cfg.prefill_buckets,
                spec=spec,
            )
            batch.adopt = lone.take_handed  # type: ignore[attr-defined]
        else:
            lone = SoloRunner(
                self.model,
                self.eos_ids,
                prefill_step_size=cfg.prefill_step_size,
                prefill_buckets=cfg.prefill_buckets,
            )
        return LoneFirstRunner(lone, batch)

    # ---- public API (any thread) -------------------------------------------------------

    def start(self) -> None:
        wired.claim(self.config.wired_bytes)
        self._wired = self.config.wired_bytes
        self._thread = threading.Thread(target=self._run, name="mlx-engine", daemon=True)
        self._thread.start()

    def submit(
        self, req: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None
    ) -> GenerationHandle:
        """Queue a request; raises Overloaded when shutting down or the queue is full, and
        InvalidRequest for one that can never fit the KV budget."""
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

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the engine thread (the one thread that may make MLX arrays) between
        two steps; its result or exception arrives through the future. From any thread."""
        future: Future[T] = Future()
        with self._sched.wake:
            if self._sched.stopping:
                raise Overloaded("the server is shutting down")
            self._calls.append((fn, future))
            self._sched.wake.notify()
        return future

    def cancel(self, request_id: str | None = None) -> int:
        """Cancel one request by id, or every queued and running one. Returns how many."""
        return self._sched.cancel(request_id)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the engine thread has warmed up and serves (True), or ``timeout``."""
        return self._ready.wait(timeout)

    @property
    def warming_up(self) -> bool:
        """Whether warm-up pieces are left for idle time (benchmarks wait for them)."""
        return self._warming is not None

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
        self._sched.stop()
        if self._thread is not None:
            self._thread.join(timeout)
        wired.release(self._wired)
        self._wired = 0

    # ---- engine thread: the loop -------------------------------------------------------

    def _run(self) -> None:
        self._warm_up()
        sched = self._sched
        while self._wait_for_work():
            self._run_calls()
            try:
                self._drop_cancelled()
                self._admit()
                if sched.active:
                    self._step()
            except Exception as e:
                if self.config.lockstep is not None:
                    self.config.lockstep.broken(e)  # the ranks no longer agree: stop
                # A fault no single sequence could be blamed for: end the running ones,
                # start the runner over; queued requests keep their place.
                self._fail(faults.step_failed(e), queued=False)
                self._runner.reset()
            self._outbox.flush()
        self._fail("cancelled", queued=True)
        self._fail_calls()
        if self._warming is not None:
            self._warming.close()  # a drain under way gives its generator back
            self._warming = None
        self._runner.close()
        if self._prompt_cache is not None:
            try:
                self._prompt_cache.close()  # RAM entries to the disk tier, within a deadline
            except Exception as e:  # the last writes are a service: stopping goes on
                self._prompt_cache.faults.note("writing the cache at shutdown", e)

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
                warm = self._warming is not None and not sched.pending
                if warm:  # a piece only once idle for a while, never with work queued
                    rest = self._busy_at + self.config.warm_idle_s - time.monotonic()
                    warm, hold = rest <= 0, min(hold, max(rest, 0.0))
                if not warm:
                    sched.wake.wait(hold)
            if warm:  # idle: the next piece of the warm-up, outside the lock
                self._warm_up_later()
                continue
            if self.config.lockstep is not None:
                self.config.lockstep.idle()  # the other ranks hear from rank 0 while idle

    def _run_calls(self) -> None:
        """Run the calls other threads asked for."""
        while self._calls:
            fn, future = self._calls.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # the caller gets it, the engine goes on
                    future.set_exception(e)

    def _fail_calls(self) -> None:
        with self._sched.wake:
            calls, self._calls = list(self._calls), deque()
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(Overloaded("the server is shutting down"))

    def _warm_up(self) -> None:
        if self.config.first_token:
            try:
                first_token(self.model)
            except Exception as e:
                self.start_error = f"the model could not compute a token: {faults.describe(e)}"
                log(f"Warm-up failed: {self.start_error}")
                self._ready.set()
                return
        if self.config.warm_up:
            try:
                n, step = self.config.max_batch_size, self.config.prefill_step_size
                buckets = self.config.prefill_buckets
                budget = self._warm_up_budget()
                plan = WarmUp(self.model, n, step, budget, buckets=buckets)
                secs = plan.before_ready()
                if budget == float("inf"):  # ranks in lockstep: every rank, every piece, now
                    while plan.pending:
                        secs += plan.step()
                what = ", the prefill buckets" if buckets else ""
                sizes, later = (
                    ("1", f"; batch sizes 2-{n} while idle") if plan.pending else (f"1-{n}", "")
                )
                log(f"Warm-up: batch sizes {sizes}{what} in {secs:.1f}s{later}")
                self._warming = plan if plan.pending else None
            except Exception as e:  # serving without it is slower at first, not wrong
                log(f"Warm-up failed: {faults.describe(e)}")
        self._ready.set()

    def _warm_up_later(self) -> None:
        """One piece of the warm-up left for idle time (see ``tuning.WarmUp``)."""
        plan = self._warming
        if plan is None:
            return
        try:
            plan.step()
        except Exception as e:  # serving goes on; shapes not warmed are built on first use
            log(f"Warm-up failed: {faults.describe(e)}")
            reset_random_state()
            self._warming = None
            return
        if not plan.pending:
            self._warming = None
            log(f"Warm-up: done while idle ({plan.spent:.1f}s in all)")

    def _warm_up_budget(self) -> float:
        """Seconds the warm-up may take; ranks in lockstep all run every warm-up step (an
        unbounded budget: all of it before serving, none left for idle time)."""
        return 30.0 if self.config.lockstep is None else float("inf")

    # ---- engine thread: starting sequences ---------------------------------------------

    def _admit(self) -> None:
        """Start queued requests, in the scheduler's order, while it lets them."""
        while (seq := self._sched.next_admissible(self._cancelled)) is not None:
            try:
                self._start(seq)
            except Exception as e:  # this request's own fault (e.g. its sampler): its error
                seq.uid = -1
                self._finish(seq, "error", error=faults.start_failed(seq, e))
        self._idle_while_reading()

    # ---- disk-tier reads off the engine thread (see PrefixCache.prepare) ---------------

    def _watch_disk_reads(self) -> None:
        """Wake the engine thread when a prefix read from disk is ready."""
        wake = self._sched.wake

        def notify() -> None:
            with wake:
                wake.notify()

        if self._prompt_cache is not None:
            self._prompt_cache.on_loaded = notify

    def _idle_while_reading(self) -> None:
        """With nothing to run but a disk read in flight, wait for it instead of spinning."""
        pc, sched = self._prompt_cache, self._sched
        with sched.wake:
            if not sched.active and not self._calls and pc is not None and pc.loading:
                sched.wake.wait(0.05)

    def _start(self, seq: Seq) -> None:
        req = seq.req
        sampler, processors = sequence_sampling(seq, req, self._samplers, self._vocab, self.eos_ids)
        prompt = list(req.prompt_tokens)
        cache, rest = None, prompt
        if self._prompt_cache is not None:
            cache, rest = self._prompt_cache.fetch(req.cache_key)
        seq.cached = len(prompt) - len(rest)
        seq.prefill_left = len(rest)
        seq.handle.cached_tokens = seq.cached
        seq.handle.push(Started(seq.cached))
        seq.system_end = self._system_end(seq, prompt)
        job = Insert(
            uid=self._sched.next_uid(),
            request=req,
            prompt=prompt,
            cached=seq.cached,
            cache=cache,
            sampler=sampler,
            processors=processors,
            system_end=seq.system_end,
            alone=self.config.solo and self._sched.is_alone(),
            checkpoints=self._checkpoints_of(req, seq.cached),
        )
        seq.uid = job.uid
        self._runner.insert(job)
        seq.begin_output(self.tokenizer)
        self._sched.run(seq)

    def _system_end(self, seq: Seq, prompt: list[int]) -> int:
        """Where the prefill pauses to save the system prompt's KV state: where that prefix
        ends, when it is not cached yet (0: no pause)."""
        end = seq.req.system_prefix_tokens
        if self._prompt_cache is None or not seq.cached < end < len(prompt) - 1:
            return 0
        return end

    def _checkpoints_of(self, req: Any, cached: int) -> tuple[int, ...]:
        """Where the prefill pauses for checkpoints (none for a cache that can be rewound)."""
        if not self._checkpoints:
            return ()
        every = self.config.checkpoint_every
        return pauses(len(req.prompt_tokens), cached, history_end=req.history_end, every=every)

    # ---- engine thread: stepping -------------------------------------------------------

    def _step(self) -> None:
        progress, responses = self._runner.step()
        active = self._sched.active
        faults.blame_shared_samplers(active.values())
        for p in progress:
            if p.uid in active:
                done_n, total = p.progress
                active[p.uid].prefill_left = total - done_n
        self._save_prefixes(progress)
        self._handle_responses(responses)

    def _handle_responses(self, responses: list[Response]) -> None:
        """Each generated token to its sequence; sequences that finished leave."""
        active = self._sched.active
        stopped: list[Seq] = []
        for r in responses:
            seq = active.get(r.uid)
            if seq is None or seq.fault is not None:
                continue  # gone, or ends below without the token its broken step produced
            try:
                reason = deliver_token(self.tokenizer, seq, r)
            except Exception as e:  # this sequence's output handling: its own error
                faults.note_output_fault(seq, e)
                continue
            if reason is None:
                continue
            active.pop(r.uid)
            if r.finish_reason is None:
                stopped.append(seq)  # a stop string matched: it leaves the runner now
            else:
                self._keep_state(seq, r.prompt_cache, r.all_tokens)
            self._finish(seq, reason)
        self._end_faulted()
        if stopped:
            saved = self._runner.remove([s.uid for s in stopped])
            for seq in stopped:
                self._keep_state(seq, *saved.get(seq.uid, (None, [])))

    def _end_faulted(self) -> None:
        """Take sequences whose own sampler, processors or output failed out of the runner
        and end each with its error; the others go on."""
        bad = faults.faulted(self._sched.active.values())
        if not bad:
            return
        self._runner.remove([s.uid for s in bad])
        for seq in bad:
            self._sched.active.pop(seq.uid, None)
            self._finish(seq, "error", error=faults.sequence_failed(seq))
        reset_random_state()

    def _save_prefixes(self, progress: list[Progress]) -> None:
        """At the end of a system-prompt segment, cache its KV state as a system entry; at
        the end of any other segment (checkpoints, and the prompt less its last token), where
        the cache cannot be rewound, as a checkpoint. A failure to copy a state drops it
        (logged once)."""
        pc, active = self._prompt_cache, self._sched.active
        if pc is None:
            return
        uids = [
            p.uid
            for p in progress
            if p.end_of_segment
            and not p.end_of_prompt
            and p.uid in active
            and (active[p.uid].system_end or self._checkpoints)
        ]
        if not uids:
            return
        try:
            states = self._runner.extract_state(uids)
        except Exception as e:
            pc.faults.note("copying a prompt's state", e)
            return
        for uid, (cache, tokens) in states.items():
            seq = active[uid]
            if seq.system_end and len(tokens) == seq.system_end:
                pc.insert(list(tokens), cache, SYSTEM)
                seq.system_end = 0
            elif self._checkpoints:  # a pause planned by _checkpoints_of, or the prompt's end
                pc.insert(list(tokens), cache, CHECKPOINT)

    # ---- engine thread: ending sequences -----------------------------------------------

    def _drop_cancelled(self) -> None:
        for seq in self._sched.take_cancelled_queued():
            self._cancelled(seq)
        active = self._sched.active
        gone = [uid for uid, s in active.items() if s.handle.cancelled]
        if gone:
            saved = self._runner.remove(gone)
            for uid in gone:
                seq = active.pop(uid)
                self._keep_state(seq, *saved.get(uid, (None, [])))
                self._finish(seq, "cancelled")

    def _keep_state(self, seq: Seq, cache: Any, tokens: Any) -> None:
        """Store a leaving sequence's KV state (prompt and generated tokens) for reuse."""
        if self._prompt_cache is not None and cache is not None and len(tokens) > seq.cached:
            self._prompt_cache.insert(list(tokens), cache)

    def _cancelled(self, seq: Seq) -> None:
        self._finish(seq, "cancelled")

    def _finish(self, seq: Seq, reason: str, error: str | None = None) -> None:
        self._sched.release(seq)
        deliver_finish(seq, reason, error, quiet=self._sched.stopping)

    def _fail(self, message: str, *, queued: bool) -> None:
        """End every running (and with ``queued``, every queued) sequence: "cancelled" when
        ``message`` is that, else an error with ``message``."""
        reason = "cancelled" if message == "cancelled" else "error"
        for seq in self._sched.take_all(queued):
            deliver_finish(seq, reason, error=message if reason == "error" else None, quiet=True)
        self._outbox.flush()
