"""The embedding engine: one thread owns MLX and runs padded encoder batches.

Every input of every queued request waits in one pool. Each step takes the oldest waiting
input and the inputs closest to it in length (so padding stays small), up to a batch size
and a token budget, runs them as one padded batch, and hands each request its results when
its last input is done. A long request therefore shares steps with short ones that arrive
while it runs, and nobody waits behind a length that keeps arriving. Cancelled requests
(the client left) lose their waiting inputs at the next step.
"""

from __future__ import annotations

import asyncio
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlx_server.engine.core.owner import OwnerThread
from mlx_server.errors import Overloaded, ServerError
from mlx_server.logs import log


@dataclass
class EmbeddingEngineConfig:
    max_batch_size: int = 64  # inputs in one step
    max_batch_tokens: int = 16384  # padded tokens in one step (batch x longest input)
    max_queue: int = 64  # requests waiting before new ones get 503


@dataclass
class _Job:
    seqs: list[list[int]]
    type_ids: list[list[int]] | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[np.ndarray]]
    results: list[Any] = field(default_factory=list)
    left: int = 0
    cancelled: bool = False
    started: bool = False

    def __post_init__(self) -> None:
        self.results = [None] * len(self.seqs)
        self.left = len(self.seqs)


@dataclass(order=True)
class _Item:
    length: int
    order: int  # arrival order: the oldest item anchors the next batch
    job: _Job = field(compare=False)
    index: int = field(compare=False)


class EmbeddingEngine(OwnerThread):
    """Batched encoder runs for the embeddings and rerank routes, usable without HTTP.

    ``runner.run(seqs, type_ids)`` (see ``encoder_runner.EncoderRunner``) is called on the
    engine thread only and returns one row per sequence. It generates nothing: it is an
    ``OwnedEngine``, not an ``EngineLike`` (no ``submit``)."""

    def __init__(self, runner: Any, config: EmbeddingEngineConfig | None = None):
        self.runner = runner
        self.config = config or EmbeddingEngineConfig()
        self._pool: list[_Item] = []
        self._jobs: list[_Job] = []
        self._order = 0
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stopping = False
        OwnerThread.__init__(self, "mlx-embedding", self._wake, lambda: self._stopping)
        self._counts = {"embedding_inputs": 0, "embedding_tokens": 0, "embedding_batches": 0}

    # ---- public API (any thread) -------------------------------------------------------

    def encode(
        self,
        seqs: list[list[int]],
        type_ids: list[list[int]] | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> asyncio.Future[list[np.ndarray]]:
        """Queue sequences (token ids, with token-type ids for sentence pairs); the future
        gets one row per sequence, in order. Cancel it to drop what has not run yet.
        Raises Overloaded when the queue is full or the engine is stopping."""
        loop = loop or asyncio.get_running_loop()
        job = _Job(seqs, type_ids, loop, loop.create_future())
        job.future.add_done_callback(lambda f: self._on_done(job, f))
        with self._wake:
            if self._stopping:
                raise Overloaded("the server is shutting down")
            if sum(1 for j in self._jobs if not j.started) >= self.config.max_queue:
                raise Overloaded(
                    f"the request queue is full ({self.config.max_queue} waiting); retry shortly"
                )
            for i, s in enumerate(seqs):
                self._pool.append(_Item(len(s), self._order, job, i))
                self._order += 1
            self._jobs.append(job)
            self._wake.notify()
        return job.future

    def cancel(self, request_id: str | None = None) -> int:
        """Embedding requests are cancelled through their futures; nothing generates."""
        return 0

    @property
    def active_count(self) -> int:
        return sum(1 for j in list(self._jobs) if j.started)

    @property
    def queue_depth(self) -> int:
        return sum(1 for j in list(self._jobs) if not j.started)

    def stats(self) -> dict[str, Any]:
        return {
            "active": self.active_count,
            "queued": self.queue_depth,
            "waiting_inputs": len(self._pool),
            **self._counts,
        }

    def _stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()

    def _on_done(self, job: _Job, future: asyncio.Future[Any]) -> None:
        if future.cancelled():
            with self._wake:
                job.cancelled = True

    # ---- engine thread -----------------------------------------------------------------

    # The loop is ``OwnerThread._run``: the calls handed in, then ``_work``, until stopping.

    def _wait_for_work(self) -> bool:
        with self._wake:
            while not self._stopping and not self._pool and not self._calls:
                self._wake.wait(0.5)
            return not self._stopping

    def _work(self) -> None:
        with self._wake:
            batch = self._next_batch()
        if batch:
            self._step(batch)

    def _stopped(self) -> None:
        self._fail_all(Overloaded("the server is shutting down"))

    def _next_batch(self) -> list[_Item]:
        """Take the oldest waiting item and its nearest neighbours in length (lock held)."""
        self._drop_cancelled()
        if not self._pool:
            return []
        self._pool.sort()
        anchor = min(range(len(self._pool)), key=lambda i: self._pool[i].order)
        lo, hi = anchor, anchor + 1  # the batch is self._pool[lo:hi]
        cap, budget = self.config.max_batch_size, self.config.max_batch_tokens
        while hi - lo < cap:
            left = self._pool[lo - 1] if lo > 0 else None
            right = self._pool[hi] if hi < len(self._pool) else None
            length = self._pool[anchor].length
            take_right = right is not None and (
                left is None or right.length - length <= length - left.length
            )
            if take_right and right is not None:
                if (hi - lo + 1) * max(right.length, 1) > budget:
                    break
                hi += 1
            elif left is not None:
                # Shorter than the batch's longest: the width stays, the count grows.
                if (hi - lo + 1) * max(self._pool[hi - 1].length, 1) > budget:
                    break
                lo -= 1
            else:
                break
        batch, self._pool[lo:hi] = self._pool[lo:hi], []
        for item in batch:
            item.job.started = True
        return batch

    def _drop_cancelled(self) -> None:
        if any(j.cancelled for j in self._jobs):
            self._pool = [it for it in self._pool if not it.job.cancelled]
            self._jobs = [j for j in self._jobs if not j.cancelled]

    def _step(self, batch: list[_Item]) -> None:
        seqs = [it.job.seqs[it.index] for it in batch]
        types = None
        if any(it.job.type_ids is not None for it in batch):
            types = [_types(it) for it in batch]
        try:
            rows = self.runner.run(seqs, types)
        except Exception as e:  # this batch's requests fail; the engine goes on
            traceback.print_exc()
            log(f"Error during embedding: {type(e).__name__}: {e}")
            self._fail({id(it.job): it.job for it in batch}.values(), e)
            return
        self._counts["embedding_batches"] += 1
        self._counts["embedding_inputs"] += len(batch)
        self._counts["embedding_tokens"] += sum(len(s) for s in seqs)
        for item, row in zip(batch, rows, strict=True):
            job = item.job
            job.results[item.index] = row
            job.left -= 1
            if job.left == 0:
                self._deliver(job)

    def _deliver(self, job: _Job) -> None:
        with self._wake:
            if job in self._jobs:
                self._jobs.remove(job)
        job.loop.call_soon_threadsafe(_resolve, job.future, job.results, None)

    def _fail(self, jobs: Any, error: Exception) -> None:
        err = ServerError(f"internal error during embedding: {type(error).__name__}: {error}")
        with self._wake:
            failed = [j for j in jobs if j in self._jobs]
            for j in failed:
                j.cancelled = True
            self._drop_cancelled()
        for j in failed:
            j.loop.call_soon_threadsafe(_resolve, j.future, None, err)

    def _fail_all(self, error: ServerError) -> None:
        with self._wake:
            jobs, self._jobs, self._pool = self._jobs, [], []
        for j in jobs:
            j.loop.call_soon_threadsafe(_resolve, j.future, None, error)


def _types(item: _Item) -> list[int]:
    types = item.job.type_ids
    return types[item.index] if types is not None else [0] * item.length


def _resolve(future: asyncio.Future[Any], result: Any, error: Exception | None) -> None:
    if future.done():  # cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
