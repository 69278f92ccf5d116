"""The embedding engine's scheduling, over a recording runner: batches grouped by length
within the size and token limits, results in order, cancelled requests dropped, a failed
batch failing only its own requests."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from mlx_server.engine.embedding.engine import EmbeddingEngine, EmbeddingEngineConfig
from mlx_server.errors import ServerError


class Recorder:
    """Returns each sequence's first token and length; records each batch's lengths. Blocks
    until released, so the tests choose what is queued when a step runs."""

    def __init__(self, fail_on: int | None = None):
        self.batches: list[list[int]] = []
        self.fail_on = fail_on
        self.gate = threading.Event()

    def run(self, seqs, type_ids=None):
        assert self.gate.wait(30)
        self.batches.append([len(s) for s in seqs])
        if self.fail_on is not None and any(s[0] == self.fail_on for s in seqs):
            raise RuntimeError("boom")
        return np.array([[s[0], len(s)] for s in seqs], dtype=np.float32)


def seqs(lengths, tag=1):
    return [[tag] * n for n in lengths]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def engine_with(runner, **kw):
    engine = EmbeddingEngine(runner, EmbeddingEngineConfig(**kw))
    engine.start()
    return engine


def test_batches_group_by_length_within_limits():
    runner = Recorder()
    engine = engine_with(runner, max_batch_size=3, max_batch_tokens=40)

    async def main():
        futures = [
            engine.encode(seqs([2, 30, 3, 31, 4]), loop=asyncio.get_running_loop()),
            engine.encode(seqs([5, 32], tag=2), loop=asyncio.get_running_loop()),
        ]
        runner.gate.set()
        return await asyncio.gather(*futures)

    try:
        first, second = run(main())
    finally:
        engine.shutdown()
    assert [int(r[1]) for r in first] == [2, 30, 3, 31, 4]  # in the request's order
    assert [int(r[0]) for r in second] == [2, 2]
    for batch in runner.batches:
        assert len(batch) <= 3 and len(batch) * max(batch) <= 40
    shorts = [b for b in runner.batches if max(b) <= 5]
    assert sorted(n for b in shorts for n in b) == [2, 3, 4, 5]
    assert len(shorts) == 2  # four short inputs: two batches of at most three, no long ones


def test_a_cancelled_request_loses_its_waiting_inputs():
    runner = Recorder()
    engine = engine_with(runner, max_batch_size=1)

    async def main():
        loop = asyncio.get_running_loop()
        kept = engine.encode(seqs([3]), loop=loop)
        dropped = engine.encode(seqs([4] * 10, tag=7), loop=loop)
        dropped.cancel()
        await asyncio.sleep(0)  # the done callback marks the request cancelled
        runner.gate.set()
        return await kept

    try:
        assert len(run(main())) == 1
        assert engine.queue_depth == 0 and engine.stats()["waiting_inputs"] == 0
    finally:
        engine.shutdown()
    assert all(b != [4] for b in runner.batches[1:])
    assert sum(len(b) for b in runner.batches) <= 2  # at most the one already taken


def test_a_failed_batch_fails_its_requests_and_the_engine_goes_on():
    runner = Recorder(fail_on=9)
    engine = engine_with(runner, max_batch_size=1)

    async def main():
        loop = asyncio.get_running_loop()
        bad = engine.encode(seqs([3], tag=9), loop=loop)
        good = engine.encode(seqs([3], tag=1), loop=loop)
        runner.gate.set()
        with pytest.raises(ServerError, match="boom"):
            await bad
        return await good

    try:
        assert int(run(main())[0][0]) == 1
    finally:
        engine.shutdown()


def test_a_full_queue_is_overloaded():
    from mlx_server.errors import Overloaded

    runner = Recorder()
    engine = engine_with(runner, max_queue=1)

    async def main():
        loop = asyncio.get_running_loop()
        running = engine.encode(seqs([3]), loop=loop)
        deadline = loop.time() + 10
        while engine.active_count == 0:  # taken by the engine thread, held at the gate
            assert loop.time() < deadline
            await asyncio.sleep(0.01)
        waiting = engine.encode(seqs([3]), loop=loop)
        with pytest.raises(Overloaded):
            engine.encode(seqs([3]), loop=loop)
        runner.gate.set()
        await asyncio.gather(running, waiting)

    try:
        run(main())
    finally:
        engine.shutdown()
