"""The engine-to-asyncio bridge and shared samplers, without a model: one wake-up per step,
merged text for a consumer that falls behind, one sampler per unseeded setting."""

from __future__ import annotations

import asyncio
import threading

import mlx.core as mx
import pytest

from mlx_server.engine.core.handle import GenerationHandle, Outbox, TokenPiece
from mlx_server.engine.sampling.samplers import SamplerPool, SharedSampler
from mlx_server.events import Finished, LogprobEntry, Timings, Usage
from mlx_server.types import SamplingParams

FINISHED = Finished("stop", Usage(3, 2), Timings(3, 1.0, 2, 1.0))


def entry(token: str) -> LogprobEntry:
    return LogprobEntry(token=token, logprob=-0.5, bytes=list(token.encode()), top=())


async def drain(handle: GenerationHandle) -> list:
    return [ev async for ev in handle]


def test_an_outbox_wakes_each_loop_once_per_flush_and_keeps_order():
    async def run():
        loop = asyncio.get_running_loop()
        outbox = Outbox()
        handles = [GenerationHandle(f"r{i}", loop, outbox) for i in range(3)]
        wakeups = 0
        real = loop.call_soon_threadsafe

        def counting(*args):
            nonlocal wakeups
            wakeups += 1
            return real(*args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]

        def engine_step():
            for i, h in enumerate(handles):
                h.push(TokenPiece(f"a{i}"))
                h.push(TokenPiece(f"b{i}"))
                h.push(FINISHED)
            outbox.flush()
            outbox.flush()  # nothing new: no wake-up

        t = threading.Thread(target=engine_step)
        t.start()
        t.join()
        results = await asyncio.gather(*(drain(h) for h in handles))
        return wakeups, results

    wakeups, results = asyncio.run(run())
    assert wakeups == 1
    for i, events in enumerate(results):
        assert [e.text for e in events[:-1]] == [f"a{i}", f"b{i}"]
        assert events[-1] is FINISHED


def test_a_consumer_that_falls_behind_gets_the_waiting_pieces_merged():
    async def run():
        h = GenerationHandle("r", asyncio.get_running_loop(), coalesce=True)
        h.push(TokenPiece("Hel", (entry("Hel"),)))
        h.push(TokenPiece("lo", (entry("lo"),)))
        h.push(TokenPiece(" world"))
        h.push(FINISHED)
        await asyncio.sleep(0)
        return await drain(h)

    events = asyncio.run(run())
    assert len(events) == 2 and events[1] is FINISHED
    assert events[0].text == "Hello world"
    assert [e.token for e in events[0].logprobs] == ["Hel", "lo"]


def test_a_consumer_that_stops_after_a_merged_piece_still_gets_the_end():
    """The event that stopped a merge is the handle's, not one iteration's: a consumer that
    leaves its loop after the merged piece (as one reading only the first token does) and
    iterates again gets the Finished event instead of waiting forever."""

    async def run():
        h = GenerationHandle("r", asyncio.get_running_loop(), coalesce=True)
        for event in (TokenPiece("a"), TokenPiece("b"), FINISHED):
            h.push(event)
        await asyncio.sleep(0)
        async for event in h:  # the first event only
            first = event
            break
        rest = await asyncio.wait_for(drain(h), timeout=5)
        return first, rest, h.done

    first, rest, done = asyncio.run(run())
    assert first.text == "ab"
    assert rest == [FINISHED] and done


def test_without_coalescing_every_piece_is_its_own_event():
    async def run():
        h = GenerationHandle("r", asyncio.get_running_loop())
        for piece in ("a", "b", "c"):
            h.push(TokenPiece(piece))
        h.push(FINISHED)
        await asyncio.sleep(0)
        return await drain(h)

    assert [getattr(e, "text", None) for e in asyncio.run(run())] == ["a", "b", "c", None]


def test_unseeded_requests_with_the_same_settings_share_one_sampler():
    pool = SamplerPool(size=2)
    checked = []
    greedy = pool.get(SamplingParams(temperature=0.0), checked.append)
    assert pool.get(SamplingParams(temperature=0.0, seed=3, top_k=5), checked.append) is greedy
    warm = SamplingParams(temperature=0.8, top_p=0.9)
    a = pool.get(warm, checked.append)
    assert (
        pool.get(SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2), checked.append)
        is a
    )
    assert a is not greedy and len(checked) == 2  # each new sampler is tried once
    assert pool.get(SamplingParams(temperature=0.8, seed=7), checked.append) is None
    rows = mx.log(mx.softmax(mx.random.normal((4, 32)), axis=-1))
    assert greedy(rows).shape == (4,) and a(rows).shape == (4,)


def test_a_failing_shared_sampler_marks_itself_and_is_replaced():
    def broken(_):
        raise ValueError("bad sampler")

    shared = SharedSampler(broken)
    out = shared(mx.zeros((2, 8)))
    assert out.shape == (2,) and shared.fault and "bad sampler" in shared.fault
    pool = SamplerPool()
    params = SamplingParams(temperature=0.5)
    first = pool.get(params, lambda s: None)
    first.fault = "sampling failed"
    assert pool.get(params, lambda s: None) is not first
    with pytest.raises(RuntimeError):
        pool.get(
            SamplingParams(temperature=0.6), lambda s: (_ for _ in ()).throw(RuntimeError("no"))
        )
