"""The engine: one thread owns MLX and runs continuous batching over mlx-lm's BatchGenerator.

Requests are admitted FIFO against a batch-size limit and a KV-memory budget; admitted ones
join the running batch after their (chunked) prefill; finished or cancelled ones leave it at
the next step. A prefix cache (``prefix_cache.PrefixCache``) lets a prompt reuse the KV state
of an earlier one that shares its prefix: finished, stopped and cancelled sequences leave
their state there, and a prompt's system-prompt prefix is saved as it is prefilled.
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences

from mlx_server.engine.handle import GenerationHandle, Outbox, Started, TokenPiece
from mlx_server.engine.logprobs import logprob_entry
from mlx_server.engine.memory import MemoryBudget
from mlx_server.engine.prefix_cache import SYSTEM, PrefixCache
from mlx_server.engine.sampling import (
    SamplerPool,
    SharedSampler,
    guard_processor,
    guard_sampler,
    make_processors,
    make_sampler,
    mask_tokens,
    reset_random_state,
)
from mlx_server.engine.solo import SoloSequence
from mlx_server.engine.tuning import warm_up
from mlx_server.errors import InvalidRequest, Overloaded
from mlx_server.events import Finished, LogprobEntry, Timings, Usage, finish_reason
from mlx_server.logs import log
from mlx_server.parsing.stops import StopMatcher
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
    prompt_cache_disk: Any = None  # disk_cache.DiskPromptCache: the prefix cache's disk tier
    warm_up: bool = False  # run every batch size once before serving (see tuning.warm_up)
    solo: bool = True  # a lone request runs on a plain KV cache (see solo.py)


@dataclass
class _Seq:
    req: GenerationRequest
    handle: GenerationHandle
    uid: int = -1
    detok: Any = None
    stops: StopMatcher | None = None
    n_generated: int = 0
    cached: int = 0
    t_submit: float = 0.0
    t_start: float = 0.0
    t_first: float = 0.0
    kv_bytes: int = 0
    system_end: int = 0  # prompt offset where the system prompt's KV state is worth caching
    prefill_left: int = 0  # prompt tokens still to prefill once inserted (0: decoding)
    uncached: int = -1  # estimate, while queued, of the tokens it will have to prefill
    logprobs: list[LogprobEntry] = field(default_factory=list)
    fault: str | None = None  # set when this sequence's own sampler or processors failed
    shared: SharedSampler | None = None  # the sampler it shares with same-settings sequences


class Engine:
    """Continuous-batching generation over one mlx-lm model, usable without HTTP."""

    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self._pending: deque[_Seq] = deque()
        self._active: dict[int, _Seq] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._kv_in_use = 0
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._prompt_cache = (
            PrefixCache(
                self.config.prompt_cache_size,
                self.config.prompt_cache_bytes,
                disk=self.config.prompt_cache_disk,
            )
            if self.config.prompt_cache_size > 0
            else None
        )
        self._memory = MemoryBudget(
            self.config.kv_budget_bytes, self._prompt_cache, lambda: self._kv_in_use
        )
        self._watch_disk_reads()
        self._eos = sorted(int(t) for t in tokenizer.eos_token_ids)
        # Width of the model's logits, to try each request's sampler before it joins a batch.
        args = getattr(model, "args", None)
        self._vocab = int(getattr(args, "vocab_size", 0) or len(tokenizer.vocab))
        self._samplers = SamplerPool()
        self._outbox: Outbox | None = Outbox()  # events of one step, one wake-up per step
        self._ready = threading.Event()
        self._solo: SoloSequence | None = None  # the lone sequence running outside the batch
        self._solo_uids = iter(range(1 << 40, 1 << 62))  # apart from BatchGenerator's uids

    # ---- public API (any thread) -------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mlx-engine", daemon=True)
        self._thread.start()

    def submit(
        self, req: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None
    ) -> GenerationHandle:
        """Queue a request; raises Overloaded when shutting down or the queue is full."""
        loop = loop or asyncio.get_running_loop()
        need = (len(req.prompt_tokens) + req.max_tokens) * self.config.kv_bytes_per_token
        if need > self.config.kv_budget_bytes:
            raise InvalidRequest(
                f"this request needs about {need >> 20} MiB of KV cache (prompt {len(req.prompt_tokens)} "
                f"+ max_tokens {req.max_tokens} tokens), more than the server's budget of "
                f"{self.config.kv_budget_bytes >> 20} MiB; lower max_tokens or shorten the prompt",
                code="kv_budget_exceeded",
            )
        handle = GenerationHandle(req.request_id, loop, self._outbox, coalesce=True)
        seq = _Seq(req=req, handle=handle, t_submit=time.perf_counter(), kv_bytes=need)
        with self._wake:
            if self._stopping:
                raise Overloaded("the server is shutting down")
            if len(self._pending) >= self.config.max_queue:
                raise Overloaded(
                    f"the request queue is full ({self.config.max_queue} waiting); retry shortly"
                )
            self._pending.append(seq)
            self._wake.notify()
        return handle

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the engine thread (the one thread that may make MLX arrays) between
        two steps; its result or exception arrives through the future. From any thread."""
        future: Future[T] = Future()
        with self._wake:
            if self._stopping:
                raise Overloaded("the server is shutting down")
            self._calls.append((fn, future))
            self._wake.notify()
        return future

    def _run_calls(self) -> None:
        """Run the calls other threads asked for (engine thread)."""
        while self._calls:
            fn, future = self._calls.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # the caller gets it, the engine goes on
                    future.set_exception(e)

    def cancel(self, request_id: str | None = None) -> int:
        """Cancel one request by id, or every queued and running one. Returns how many."""
        n = 0
        with self._wake:
            for seq in list(self._pending) + list(self._active.values()):
                if not seq.handle.cancelled and (
                    request_id is None or seq.req.request_id == request_id
                ):
                    seq.handle.cancel()
                    n += 1
            self._wake.notify()
        return n

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the engine thread has warmed up and serves (True), or ``timeout``."""
        return self._ready.wait(timeout)

    @property
    def active_count(self) -> int:
        return len(self._active)

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The prefix cache (owned by the engine thread: read it only while idle)."""
        return self._prompt_cache

    def stats(self) -> dict[str, Any]:
        """Counters for monitoring; safe to call from any thread."""
        active = list(self._active.values())  # a snapshot: the engine thread mutates the dict
        return {
            "active": len(active),
            "prefilling": sum(1 for s in active if s.prefill_left > 0),
            "next_prefill_tokens": self._prefill_load(active),
            "queued": self.queue_depth,
            "kv_in_use_bytes": self._kv_in_use,
            **self._memory.stats(),
            **(
                self._prompt_cache.stats()
                if self._prompt_cache is not None
                else {"prompt_cache_entries": 0}
            ),
        }

    def shutdown(self, timeout: float = 3.0) -> None:
        """Cancel everything, stop the thread and wait for it (bounded)."""
        with self._wake:
            self._stopping = True
            for seq in list(self._pending) + list(self._active.values()):
                seq.handle.cancel()
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        self._warm_up()
        gen = self._new_generator()
        while True:
            with self._wake:
                while (
                    not self._stopping
                    and not self._pending
                    and not self._active
                    and not self._calls
                ):
                    self._wake.wait(0.5)
                if self._stopping and not self._active and not self._pending:
                    break
            self._run_calls()
            try:
                self._drop_cancelled(gen)
                self._admit(gen)
                if self._active:
                    self._step(gen)
                self._flush()
            except Exception as e:
                # A fault no single sequence could be blamed for: end the running ones with
                # an error, start over with a fresh generator and random state; queued
                # requests keep their place.
                traceback.print_exc()
                log(f"Error during generation: {type(e).__name__}: {e}")
                self._fail_active(f"internal error during generation: {type(e).__name__}: {e}")
                gen = self._new_generator()
                reset_random_state()
                self._flush()
        self._fail_all("cancelled", reason="cancelled")
        self._flush()
        self._fail_calls()
        gen.close()
        if self._prompt_cache is not None:
            self._prompt_cache.close()  # RAM entries to the disk tier, within a deadline

    def _fail_calls(self) -> None:
        with self._wake:
            calls, self._calls = list(self._calls), deque()
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(Overloaded("the server is shutting down"))

    def _flush(self) -> None:
        """Hand this step's events to the consumers' event loops, one wake-up each."""
        if self._outbox is not None:
            self._outbox.flush()

    def _warm_up(self) -> None:
        if self.config.warm_up:
            try:
                n, step = self.config.max_batch_size, self.config.prefill_step_size
                secs = warm_up(self.model, n, step)
                log(f"Warm-up: batch sizes 1-{n} and a {step}-token prefill in {secs:.1f}s")
            except Exception as e:  # serving without it is slower at first, not wrong
                log(f"Warm-up failed: {type(e).__name__}: {e}")
        self._ready.set()

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self.model,
            completion_batch_size=self.config.max_batch_size,
            # Prompts that arrive together prefill together; _may_start_prefill bounds the
            # tokens one step prefills.
            prefill_batch_size=self.config.max_batch_size,
            prefill_step_size=self.config.prefill_step_size,
            stop_tokens=[[t] for t in self._eos],
        )

    def _admit(self, gen: BatchGenerator) -> None:
        """Start queued requests, in order, while the batch has room. A long request that
        must wait (for memory, or for the prefills ahead of it) keeps later long ones
        waiting behind it, but a short one may pass: it needs little memory and prefills
        in one step, so it starts within a step or two of arriving."""
        while True:
            with self._wake:
                seq = self._next_admissible()
                if seq is None:
                    self._idle_while_reading()
                    return
                self._pending.remove(seq)
            self._migrate(gen)  # a lone sequence joins the batch before another starts
            try:
                self._insert(gen, seq)
            except Exception as e:  # this request's own fault (e.g. its sampler): its error
                self._fault(seq, e)

    def _next_admissible(self) -> _Seq | None:
        """The first queued request that may start now (call with the lock held)."""
        blocked = False
        for seq in list(self._pending):
            if len(self._active) >= self.config.max_batch_size:
                return None
            if seq.handle.cancelled:
                self._pending.remove(seq)
                self._finish(seq, "cancelled")
                continue
            if not self._cache_ready(seq):
                continue  # its cached prefix is being read from disk; others may pass
            short = self._uncached(seq) <= self.config.prefill_step_size
            if blocked and not short:
                continue
            # The budget counts the prefix cache and MLX's buffer cache too; they give
            # memory back before a request waits.
            fits = not self._active or self._memory.fits(self._kv_in_use + seq.kv_bytes)
            if fits and (short or self._may_start_prefill(seq)):
                return seq
            blocked = True
        return None

    # ---- disk-tier reads off the engine thread (see PrefixCache.prepare) ---------------

    def _watch_disk_reads(self) -> None:
        """Wake the engine thread when a prefix read from disk is ready."""

        def wake() -> None:
            with self._wake:
                self._wake.notify()

        if self._prompt_cache is not None:
            self._prompt_cache.on_loaded = wake

    def _cache_ready(self, seq: _Seq) -> bool:
        """Whether a queued request's cached prefix is in memory (its disk read is done)."""
        pc = self._prompt_cache
        return pc is None or pc.prepare(seq.req.prompt_tokens)

    def _idle_while_reading(self) -> None:
        """With nothing to run but a disk read in flight, wait for it instead of spinning
        (call with the lock held)."""
        pc = self._prompt_cache
        if not self._active and not self._calls and pc is not None and pc.loading:
            self._wake.wait(0.05)

    def _uncached(self, seq: _Seq) -> int:
        """Prompt tokens this queued request will prefill (prefix-cache hits excluded)."""
        if seq.uncached < 0:
            prompt = seq.req.prompt_tokens
            hit = self._prompt_cache.cached_length(prompt) if self._prompt_cache is not None else 0
            seq.uncached = len(prompt) - hit
        return seq.uncached

    def _may_start_prefill(self, seq: _Seq) -> bool:
        """Pace prefill so that running streams keep producing: BatchGenerator prefills one
        chunk (at most prefill_step_size tokens) of every prompt in flight per decode step,
        so a prompt starts only while the chunks of one step stay within two step sizes.
        Short prompts arriving together still share a step; long ones do not pile up."""
        step = self.config.prefill_step_size
        load = self._prefill_load(self._active.values())
        if load == 0:
            return True
        return load + min(self._uncached(seq), step) <= 2 * step

    def _prefill_load(self, seqs: Any) -> int:
        """Prompt tokens the next step prefills (at most): one chunk per prompt in flight."""
        return sum(min(s.prefill_left, self.config.prefill_step_size) for s in seqs)

    def _insert(self, gen: BatchGenerator, seq: _Seq) -> None:
        req = seq.req
        sampler = self._checked_sampler(seq)
        extra = [mask_tokens(self._eos)] if req.ignore_eos else []
        processors = [
            guard_processor(seq, p)
            for p in list(make_processors(req.sampling)) + list(req.logits_processors) + extra
        ]
        prompt = list(req.prompt_tokens)
        cache, rest = None, prompt
        if self._prompt_cache is not None:
            cache, rest = self._prompt_cache.fetch(prompt)
        seq.cached = len(prompt) - len(rest)
        seq.prefill_left = len(rest)
        seq.handle.cached_tokens = seq.cached
        seq.handle.push(Started(seq.cached))
        segments = self._segments(seq, prompt)
        if self._runs_alone(processors):
            uid = next(self._solo_uids)
            self._solo = SoloSequence(
                self.model,
                uid,
                prompt,
                seq.cached,
                cache,
                sampler=sampler,
                max_tokens=req.max_tokens,
                eos=self._eos,
                prefill_step_size=self.config.prefill_step_size,
                system_end=seq.system_end,
                on_system_prefix=self._save_system_state(seq),
            )
        else:
            (uid,) = gen.insert_segments(
                segments=[segments],
                max_tokens=[req.max_tokens],
                caches=[cache] if cache is not None else None,
                all_tokens=[prompt[: seq.cached]],
                samplers=[sampler],
                logits_processors=[processors],
                stop_sequences=[StopSequences([[t] for t in self._eos])],
            )
        seq.uid = uid
        seq.detok = self.tokenizer.detokenizer
        seq.stops = StopMatcher(req.stop)
        seq.t_start = time.perf_counter()
        self._kv_in_use += seq.kv_bytes
        self._active[uid] = seq

    def _runs_alone(self, processors: list[Any]) -> bool:
        """Whether a request starting now runs as the solo sequence: nothing else running
        or waiting, and no logits processors (the batch applies those)."""
        return (
            self.config.solo
            and self._solo is None
            and not self._active
            and not self._pending
            and not processors
        )

    def _save_system_state(self, seq: _Seq) -> Any:
        def save(tokens: list[int], cache: Any) -> None:
            if self._prompt_cache is not None:
                self._prompt_cache.insert(tokens, cache, SYSTEM)
            seq.system_end = 0

        return save

    def _migrate(self, gen: BatchGenerator) -> None:
        """Hand the solo sequence over to the batch: its pending token is emitted here,
        then it joins the BatchGenerator with its cache, as a prefix-cache hit would."""
        solo = self._solo
        if solo is None:
            return
        pending = solo.take_pending()
        if pending is not None:
            self._handle_responses(gen, [pending])
        self._solo = None
        seq = self._active.pop(solo.uid, None)
        if seq is None:  # it ended with that token
            return
        todo, cache, fed, left = solo.handover()
        (seq.uid,) = gen.insert_segments(
            segments=[[todo]],
            max_tokens=[left],
            caches=[cache],
            all_tokens=[fed],
            samplers=[solo.sampler],
            logits_processors=[[]],
            stop_sequences=[StopSequences([[t] for t in self._eos])],
        )
        self._active[seq.uid] = seq

    def _remove(self, gen: BatchGenerator, uids: list[int]) -> dict[int, Any]:
        """Take sequences out of the batch (or the solo one); their (cache, tokens)."""
        saved = gen.remove(uids, return_prompt_caches=self._prompt_cache is not None)
        solo = self._solo
        if solo is not None and solo.uid in uids:
            saved[solo.uid] = (solo.cache, solo.fed)
            self._solo = None
        return saved

    def _checked_sampler(self, seq: _Seq) -> Any:
        """The request's sampler, tried once on a row of the model's logits width: a sampler
        that cannot work fails its own request here, before it joins (and breaks) a batch.
        Unseeded requests with the same settings share one (tried when it is made), so the
        batch samples in one call."""

        def check(sampler: Any) -> None:
            mx.eval(sampler(mx.zeros((1, self._vocab), dtype=mx.float32)))

        seq.shared = self._samplers.get(seq.req.sampling, check)
        if seq.shared is not None:
            return seq.shared
        sampler = make_sampler(seq.req.sampling)
        check(sampler)
        return guard_sampler(seq, sampler)

    def _segments(self, seq: _Seq, prompt: list[int]) -> list[list[int]]:
        """The uncached prompt, split where the system prompt ends when that prefix is not
        cached yet: prefill pauses at a segment boundary, where its KV state is saved."""
        end = seq.req.system_prefix_tokens
        if self._prompt_cache is None or not seq.cached < end < len(prompt) - 1:
            return [prompt[seq.cached :]]
        seq.system_end = end
        return [prompt[seq.cached : end], prompt[end:]]

    def _drop_cancelled(self, gen: BatchGenerator) -> None:
        with self._wake:  # a client that left the queue frees its queue slot now
            queued = [s for s in self._pending if s.handle.cancelled]
            for seq in queued:
                self._pending.remove(seq)
        for seq in queued:
            self._finish(seq, "cancelled")
        gone = [uid for uid, s in self._active.items() if s.handle.cancelled]
        if gone:
            saved = self._remove(gen, gone)
            for uid in gone:
                seq = self._active.pop(uid)
                self._keep_state(seq, *saved.get(uid, (None, ())))
                self._finish(seq, "cancelled")

    def _keep_state(self, seq: _Seq, cache: Any, tokens: Any) -> None:
        """Store a leaving sequence's KV state (prompt and generated tokens) for reuse."""
        if self._prompt_cache is not None and cache is not None and len(tokens) > seq.cached:
            self._prompt_cache.insert(list(tokens), cache)

    def _step(self, gen: BatchGenerator) -> None:
        progress, responses = self._solo.next() if self._solo is not None else gen.next()
        for running in self._active.values():
            shared = running.shared
            if running.fault is None and shared is not None and shared.fault is not None:
                running.fault = shared.fault  # a shared sampler failed: all its users end
        for p in progress:
            if p.uid in self._active:
                done_n, total = p.progress
                self._active[p.uid].prefill_left = total - done_n
        self._save_system_prefixes(gen, progress)
        self._handle_responses(gen, responses)

    def _handle_responses(self, gen: BatchGenerator, responses: list[Any]) -> None:
        """Each generated token to its sequence; sequences that finished leave."""
        done: list[_Seq] = []
        for r in responses:
            seq = self._active.get(r.uid)
            if seq is None:
                continue
            if seq.fault is not None:
                continue  # ends below, without the token its broken step produced
            if not seq.t_first:
                seq.t_first = time.perf_counter()
                seq.prefill_left = 0
            seq.n_generated += 1
            try:
                reason = self._on_token(seq, r)
            except Exception as e:  # this sequence's output handling: its own error
                traceback.print_exc()
                seq.fault = f"{type(e).__name__}: {e}"
                continue
            if reason is None:
                continue
            self._active.pop(r.uid)
            if r.finish_reason is None:
                done.append(seq)  # a stop string matched: leave the batch now
            else:
                self._keep_state(seq, r.prompt_cache, r.all_tokens)
            self._finish(seq, reason)
        self._end_faulted(gen)
        solo = self._solo
        if (
            solo is not None
            and solo.uid not in self._active
            and not any(s.uid == solo.uid for s in done)
        ):
            self._solo = None  # it finished
        if done:
            saved = self._remove(gen, [s.uid for s in done])
            for seq in done:
                self._keep_state(seq, *saved.get(seq.uid, (None, ())))

    def _end_faulted(self, gen: BatchGenerator) -> None:
        """Take sequences whose own sampler, processors or output failed out of the batch
        and end each with its error; the rest of the batch goes on."""
        faulted = [s for s in self._active.values() if s.fault is not None]
        if not faulted:
            return
        self._remove(gen, [s.uid for s in faulted])
        for seq in faulted:
            self._active.pop(seq.uid, None)
            log(f"Error during generation of {seq.req.request_id}: {seq.fault}")
            self._finish(seq, "error", error=f"generation failed: {seq.fault}")
        reset_random_state()

    def _fault(self, seq: _Seq, e: Exception) -> None:
        """A request that failed before it joined the batch ends with its error."""
        traceback.print_exc()
        log(f"Error starting generation of {seq.req.request_id}: {type(e).__name__}: {e}")
        self._finish(seq, "error", error=f"generation failed: {type(e).__name__}: {e}")
        reset_random_state()

    def _save_system_prefixes(self, gen: BatchGenerator, progress: list[Any]) -> None:
        """At the end of a system-prompt segment, cache its KV state as a system entry."""
        uids = [
            p.uid
            for p in progress
            if p.end_of_segment
            and not p.end_of_prompt
            and p.uid in self._active
            and self._active[p.uid].system_end
        ]
        if not uids or self._prompt_cache is None:
            return
        for uid, (cache, tokens) in gen.extract_cache(uids).items():
            seq = self._active[uid]
            if len(tokens) == seq.system_end:
                self._prompt_cache.insert(list(tokens), cache, SYSTEM)
                seq.system_end = 0

    def _on_token(self, seq: _Seq, r: Any) -> str | None:
        """Detokenize, apply stop strings and logprobs; return a finish reason or None."""
        if r.finish_reason == "stop":  # an EOS token: not part of the text
            seq.detok.finalize()
        else:
            seq.detok.add_token(r.token)
            if r.finish_reason == "length":
                seq.detok.finalize()
        text = seq.detok.last_segment
        entries: tuple[LogprobEntry, ...] = ()
        if seq.req.logprobs:
            entries = (logprob_entry(self.tokenizer, r.token, r.logprobs, seq.req.top_logprobs),)
        out = seq.stops.feed(text) if seq.stops else text
        if seq.stops is not None and seq.stops.matched is None and r.finish_reason is not None:
            out += seq.stops.flush()
        if out or entries:
            seq.handle.push(TokenPiece(out, entries))
        if seq.stops is not None and seq.stops.matched is not None:
            return "stop_sequence"
        if r.finish_reason is not None:
            return r.finish_reason
        return None

    def _finish(self, seq: _Seq, reason: str, error: str | None = None) -> None:
        now = time.perf_counter()
        self._kv_in_use = (
            max(0, self._kv_in_use - seq.kv_bytes) if seq.uid >= 0 else self._kv_in_use
        )
        prompt_n = len(seq.req.prompt_tokens) - seq.cached
        t_first = seq.t_first or now
        timings = Timings(
            prompt_n=prompt_n,
            prompt_ms=((t_first - seq.t_start) * 1000) if seq.t_start else 0.0,
            predicted_n=seq.n_generated,
            predicted_ms=(now - t_first) * 1000,
            cache_n=seq.cached,
        )
        usage = Usage(len(seq.req.prompt_tokens), seq.n_generated, seq.cached)
        stop = seq.stops.matched if seq.stops is not None else None
        finished = Finished(finish_reason(reason), usage, timings, stop_sequence=stop, error=error)
        seq.handle.push(finished)
        if reason != "cancelled" and seq.n_generated:
            log(
                f"Generation: {timings.prompt_n} prompt tokens at {timings.prompt_per_second:.1f} tokens/sec, "
                f"{timings.predicted_n} generated at {timings.predicted_per_second:.1f} tokens/sec "
                f"(cached {seq.cached}, finish={reason})"
            )
        elif reason == "cancelled" and not self._stopping:
            log(f"Generation {seq.req.request_id} cancelled {self._progress(seq)}")

    def _progress(self, seq: _Seq) -> str:
        """Where a generation stood, for the log."""
        if seq.uid < 0:
            return "while queued"
        todo = len(seq.req.prompt_tokens) - seq.cached
        done = todo - seq.prefill_left if not seq.t_first else todo
        return f"after {done} of {todo} prompt tokens prefilled, {seq.n_generated} generated"

    def _fail_active(self, message: str) -> None:
        self._solo = None
        with self._wake:
            seqs = list(self._active.values())
            self._active.clear()
        for seq in seqs:
            self._finish(seq, "error", error=message)
        self._kv_in_use = 0

    def _fail_all(self, message: str, reason: str = "error") -> None:
        self._solo = None
        with self._wake:
            seqs = list(self._active.values()) + list(self._pending)
            self._active.clear()
            self._pending.clear()
        for seq in seqs:
            self._finish(seq, reason, error=message if reason == "error" else None)
        self._kv_in_use = 0
