"""The scheduler: the queue, admission, fairness between long and short prompts, the KV
budget. It decides which request starts and when; the runner computes the running ones.

Requests are admitted FIFO against a batch-size limit and a KV-memory budget. A long
request that must wait (for memory, or for the prefills ahead of it) keeps later long ones
waiting behind it, but a short one may pass: it needs little memory and prefills in one
step, so it starts within a step or two of arriving. Prefill is paced so running streams
keep producing (``may_start_prefill``).

Requests that arrive together start together. The chat service announces a request
(``expect``) before it renders and tokenizes the prompt in a worker thread; while announced
requests are still on their way, the queued ones wait for them, up to ``gather_s`` after the
oldest was queued. A burst of N then prefills as one batch and decodes at batch size N from
its first step, instead of the first request starting alone and the rest joining in waves:
each wave would be another prefill pass and, on MLX's CUDA backend, new shapes whose kernels
are built on first use. A lone request is never held: its own announcement ends as it is
queued.

``submit``, ``cancel`` and ``stats`` are safe from any thread; the rest belongs to the
engine thread, under ``lock`` where the queue is touched.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from mlx_server.engine.cache.prefix import PrefixCache
from mlx_server.engine.core.delivery import Seq
from mlx_server.engine.core.handle import GenerationHandle
from mlx_server.engine.core.memory import MemoryBudget
from mlx_server.errors import (
    ContextLengthExceeded,
    Overloaded,
    RequestTooLarge,
    overflow_message,
)
from mlx_server.types import GenerationRequest

# A request with media is refused only when its KV and this share of its tower's estimate
# cannot fit the budget (vision_memory's estimate is an upper bound; see ``queue``).
MEDIA_REFUSAL_DIVISOR = 4


class Scheduler:
    """Queued and running sequences and the rules for starting them."""

    def __init__(
        self,
        *,
        max_batch_size: int,
        max_queue: int,
        prefill_step_size: int,
        kv_budget_bytes: int,
        kv_bytes_per_token: int,
        prefix_cache: PrefixCache | None,
        gather_s: float = 0.0,
        kv_bytes_per_sequence: int = 0,
        media_bytes: Callable[[GenerationRequest], int] | None = None,
    ):
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.step_size = prefill_step_size
        self.kv_budget_bytes = kv_budget_bytes
        self.kv_bytes_per_token = kv_bytes_per_token
        # Bytes a sequence holds whatever its length: sliding windows, recurrent states.
        self.kv_bytes_per_sequence = kv_bytes_per_sequence
        # A vision model: the memory its tower takes for a request's media (vision_memory).
        self.media_bytes = media_bytes
        self.pending: deque[Seq] = deque()
        self.active: dict[int, Seq] = {}
        # Re-entrant: a prefix read from disk that is already done when next_admissible asks
        # for it calls its wake-up at once, on this thread, with the lock held.
        self.lock = threading.RLock()
        self.wake = threading.Condition(self.lock)
        self.stopping = False
        self.kv_in_use = 0
        self.gather_s = gather_s
        self.expected: set[str] = set()  # request ids announced, not yet queued
        self._prefix_cache = prefix_cache
        self.memory = MemoryBudget(kv_budget_bytes, prefix_cache, lambda: self.kv_in_use)
        self._uids = iter(range(1 << 62))

    # ---- any thread --------------------------------------------------------------------

    def queue(self, req: GenerationRequest, handle: GenerationHandle) -> None:
        """Queue a request; raises ContextLengthExceeded if its KV can never fit the budget,
        RequestTooLarge if its KV and its media in the vision tower cannot, Overloaded when
        shutting down or the queue is full."""
        n_prompt = len(req.prompt_tokens)
        need = (n_prompt + req.max_tokens) * self.kv_bytes_per_token + self.kv_bytes_per_sequence
        if need > self.kv_budget_bytes:
            # Worded as a context overflow, which clients (Jan among them) recover from.
            longest = self.longest_context()
            raise ContextLengthExceeded(
                overflow_message(n_prompt, req.max_tokens, longest)
                + f" (the memory for KV holds {longest} tokens: {self.kv_budget_bytes >> 20} MiB)",
                param="max_tokens",
                n_prompt_tokens=n_prompt,
                n_ctx=longest,
            )
        media = self.media_bytes(req) if self.media_bytes and req.vision_inputs else 0
        # The tower's count is high by design (attention scores even where they are fused,
        # every layer's states): it makes a request wait for room, and refuses one only when
        # even a share of it cannot fit, so an image that would run is not turned away.
        if need + media // MEDIA_REFUSAL_DIVISOR > self.kv_budget_bytes:
            raise RequestTooLarge(
                f"the request's images need about {_mib(media)} of memory in the vision "
                f"tower, beside {_mib(need)} for its KV: more than the memory budget "
                f"({_mib(self.kv_budget_bytes)}, --kv-budget-gb); send fewer or smaller images",
                param="messages",
            )
        seq = Seq(
            req=req,
            handle=handle,
            t_submit=time.perf_counter(),
            kv_bytes=need,
            media_bytes=media,
        )
        with self.wake:
            if self.stopping:
                raise Overloaded("the server is shutting down")
            if len(self.pending) >= self.max_queue:
                raise Overloaded(
                    f"the request queue is full ({self.max_queue} waiting); retry shortly"
                )
            self.expected.discard(req.request_id)
            self.pending.append(seq)
            self.wake.notify()

    def longest_context(self) -> int:
        """The most tokens one sequence can hold within the KV budget."""
        room = self.kv_budget_bytes - self.kv_bytes_per_sequence
        return max(0, room // max(1, self.kv_bytes_per_token))

    def expect(self, request_id: str) -> None:
        """A request is on its way (its prompt is being built); see the module docstring."""
        if self.gather_s > 0:
            with self.wake:
                self.expected.add(request_id)

    def withdraw(self, request_id: str) -> None:
        """An announced request will not come (or came: then nothing changes)."""
        with self.wake:
            if request_id in self.expected:
                self.expected.discard(request_id)
                self.wake.notify()

    def gather_left(self) -> float:
        """Seconds the queued requests still wait for announced ones (0: none)."""
        if not self.expected or not self.pending:
            return 0.0
        return max(0.0, self.pending[0].t_submit + self.gather_s - time.perf_counter())

    def cancel(self, request_id: str | None = None) -> int:
        """Mark one request (by id) or every queued and running one cancelled; how many."""
        n = 0
        with self.wake:
            for seq in list(self.pending) + list(self.active.values()):
                if not seq.handle.cancelled and (
                    request_id is None or seq.req.request_id == request_id
                ):
                    seq.handle.cancel()
                    n += 1
            self.wake.notify()
        return n

    def stop(self) -> None:
        """Refuse new requests and cancel every queued and running one."""
        with self.wake:
            self.stopping = True
            for seq in list(self.pending) + list(self.active.values()):
                seq.handle.cancel()
            self.wake.notify()

    def stats(self) -> dict[str, Any]:
        active = list(self.active.values())  # a snapshot: the engine thread mutates the dict
        return {
            "active": len(active),
            "prefilling": sum(1 for s in active if s.prefill_left > 0),
            "next_prefill_tokens": self.prefill_load(active),
            "queued": len(self.pending),
            "kv_in_use_bytes": self.kv_in_use,
            **self.memory.stats(),
        }

    # ---- engine thread -----------------------------------------------------------------

    def next_admissible(self, on_cancelled: Callable[[Seq], None]) -> Seq | None:
        """Take the first queued request that may start now out of the queue (None if none
        may); cancelled ones met on the way leave through ``on_cancelled``."""
        with self.wake:
            if self.gather_left() > 0:
                return None  # the rest of a burst is on its way
            blocked = False
            for seq in list(self.pending):
                if len(self.active) >= self.max_batch_size:
                    return None
                if seq.handle.cancelled:
                    self.pending.remove(seq)
                    on_cancelled(seq)
                    continue
                if self._prefix_cache is not None and not self._prefix_cache.prepare(
                    seq.req.cache_key
                ):
                    continue  # its cached prefix is being read from disk; others may pass
                short = self.uncached(seq) <= self.step_size
                if blocked and not short:
                    continue
                # The budget counts the prefix cache and MLX's buffer cache too; they give
                # memory back before a request waits. A request with media counts its
                # vision tower too, and makes room for it even when it would run alone.
                media = self.media_needed(seq)
                need = self.kv_in_use + seq.kv_bytes + media
                fits = (not self.active and not media) or self.memory.fits(need)
                if fits and media < seq.media_bytes and self.media_needed(seq, fresh=True):
                    # making room evicted the cached prefix that held its media: count them
                    fits = self.memory.fits(need + seq.media_bytes)
                fits = fits or not self.active  # alone it fits (``queue`` checked)
                if fits and (short or self.may_start_prefill(seq)):
                    self.pending.remove(seq)
                    return seq
                blocked = True
            return None

    def media_needed(self, seq: Seq, fresh: bool = False) -> int:
        """The tower memory this queued request will take: none when the prefix cache holds
        every media placeholder of its prompt, for then no tower runs (the text path takes
        the request on: ``runners/vision_batch``); ``fresh``: look the prefix up again."""
        key = seq.req.cache_tokens
        if not seq.media_bytes or key is None or self._prefix_cache is None:
            return seq.media_bytes
        if fresh:
            seq.uncached = -1
        prompt = seq.req.prompt_tokens
        todo = slice(len(key) - self.uncached(seq), len(prompt) - 1)  # as runners/vision_batch
        return 0 if key[todo] == list(prompt[todo]) else seq.media_bytes

    def uncached(self, seq: Seq) -> int:
        """Prompt tokens this queued request will prefill (prefix-cache hits excluded)."""
        if seq.uncached < 0:
            prompt = seq.req.cache_key
            cache = self._prefix_cache
            seq.uncached = len(prompt) - (cache.cached_length(prompt) if cache is not None else 0)
        return seq.uncached

    def may_start_prefill(self, seq: Seq) -> bool:
        """Pace prefill so that running streams keep producing: the batch prefills one
        chunk (at most prefill_step_size tokens) of every prompt in flight per decode step,
        so a prompt starts only while the chunks of one step stay within two step sizes.
        Short prompts arriving together still share a step; long ones do not pile up."""
        load = self.prefill_load(self.active.values())
        if load == 0:
            return True
        return load + min(self.uncached(seq), self.step_size) <= 2 * self.step_size

    def prefill_load(self, seqs: Iterable[Seq]) -> int:
        """Prompt tokens the next step prefills (at most): one chunk per prompt in flight."""
        return sum(min(s.prefill_left, self.step_size) for s in seqs)

    def take_cancelled_queued(self) -> list[Seq]:
        """Queued requests whose client left: out of the queue now, freeing their slots."""
        with self.wake:
            gone = [s for s in self.pending if s.handle.cancelled]
            for seq in gone:
                self.pending.remove(seq)
        return gone

    def is_alone(self) -> bool:
        """Nothing runs and nothing waits (a starting request may take a lone path)."""
        return not self.active and not self.pending

    def next_uid(self) -> int:
        """A key for a starting sequence, never used before."""
        return next(self._uids)

    def run(self, seq: Seq) -> None:
        """Count an admitted sequence (its uid set) as running."""
        self.kv_in_use += seq.kv_bytes
        self.active[seq.uid] = seq

    def release(self, seq: Seq) -> None:
        """A sequence ended: its KV bytes go back to the budget."""
        if seq.uid >= 0:
            self.kv_in_use = max(0, self.kv_in_use - seq.kv_bytes)

    def take_all(self, queued: bool) -> list[Seq]:
        """Every running (and with ``queued``, every queued) sequence, taken out."""
        with self.wake:
            seqs = list(self.active.values()) + (list(self.pending) if queued else [])
            self.active.clear()
            if queued:
                self.pending.clear()
        self.kv_in_use = 0
        return seqs


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
