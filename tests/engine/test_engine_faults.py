"""A failure stays with the request that caused it: the real engine on the tiny model ends a
faulty sequence alone, keeps the rest of the batch and the queue, and serves the next
request after any fault. Short requests are not starved by long prefills."""

from __future__ import annotations

import asyncio
import random

import pytest
from engine_runner import (
    collect,
    drive,
    generate,
    load_varied_model,
    request,
    running_engine,
    solo,
    until,
)

from mlx_server.engine.core.handle import Started, TokenPiece
from mlx_server.events import Finished
from mlx_server.types import SamplingParams

SAMPLED = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    model, tokenizer, _ = load_varied_model(tmp_path_factory)
    return model, tokenizer


def tokens(tokenizer, n_words: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    words = "alpha beta gamma delta paris france hello world quick brown fox".split()
    return list(tokenizer.encode(" ".join(rng.choice(words) for _ in range(n_words))))


def vocab_width(model) -> int:
    return int(model.args.vocab_size)


def test_a_bad_seed_fails_alone_and_its_neighbour_finishes(lm):
    model, tokenizer = lm
    p = tokens(tokenizer, 12, 1)
    with running_engine(model, tokenizer) as engine:
        (expected,) = solo(engine, [request(p, 12)])

        async def run():
            bad = engine.submit(request(p, 12, sampling=SamplingParams(1.0, seed=1 << 64)))
            good = engine.submit(request(p, 12))
            return await asyncio.gather(collect(bad), collect(good))

        bad, good = drive(engine, run())
        assert bad.reason == "error" and "seed" not in bad.text
        assert bad.finished.error and "TypeError" in bad.finished.error
        assert good.reason == expected.reason and good.text == expected.text
        assert engine.active_count == 0 and engine.queue_depth == 0


def test_a_top_k_beyond_the_vocabulary_fails_alone_then_sampling_works(lm):
    model, tokenizer = lm
    p = tokens(tokenizer, 10, 2)
    with running_engine(model, tokenizer) as engine:
        wide = SamplingParams(temperature=1.0, top_k=vocab_width(model))
        (bad,) = solo(engine, [request(p, 8, sampling=wide)])
        assert bad.reason == "error" and "top_k" in (bad.finished.error or "")
        # Unseeded sampling draws on MLX's global random state, which the fault must not
        # have left broken.
        after = solo(engine, [request(p, 8, sampling=SAMPLED) for _ in range(3)])
        assert all(r.reason in ("length", "stop") and r.finished.error is None for r in after)


class FailingProcessor:
    """A logits processor that raises on its ``n``-th call."""

    def __init__(self, n: int):
        self.n = n
        self.calls = 0

    def __call__(self, tokens, logits):
        self.calls += 1
        if self.calls >= self.n:
            raise RuntimeError("processor exploded")
        return logits


def test_a_failing_processor_ends_its_sequence_and_the_batch_goes_on(lm):
    model, tokenizer = lm
    p1, p2 = tokens(tokenizer, 14, 3), tokens(tokenizer, 9, 4)
    with running_engine(model, tokenizer) as engine:
        expected = solo(engine, [request(p1, 16), request(p2, 16)])

        async def run():
            handles = [
                engine.submit(request(p1, 16)),
                engine.submit(request(p2, 16, logits_processors=(FailingProcessor(4),))),
                engine.submit(request(p2, 16)),
            ]
            return await asyncio.gather(*(collect(h) for h in handles))

        first, failed, third = drive(engine, run())
        assert failed.reason == "error" and "processor exploded" in (failed.finished.error or "")
        assert failed.finished.usage.completion_tokens < 16
        assert (first.text, first.reason) == (expected[0].text, expected[0].reason)
        assert (third.text, third.reason) == (expected[1].text, expected[1].reason)


def test_after_a_step_fault_queued_requests_and_the_next_one_succeed(lm, monkeypatch):
    """A fault inside the batch step that no sequence can be blamed for ends the running
    sequences with an error; queued ones keep their place, and later requests work."""
    model, tokenizer = lm
    p = tokens(tokenizer, 10, 5)
    with running_engine(model, tokenizer, max_batch_size=1) as engine:
        from mlx_lm.generate import BatchGenerator

        real_next = BatchGenerator.next
        calls = {"n": 0}

        def flaky_next(self):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("device fault")
            return real_next(self)

        monkeypatch.setattr(BatchGenerator, "next", flaky_next)

        async def run():
            running = engine.submit(request(p, 12))
            queued = engine.submit(request(p, 12))
            return await asyncio.gather(collect(running), collect(queued))

        running, queued = drive(engine, run())
        assert running.reason == "error" and "device fault" in (running.finished.error or "")
        assert queued.reason in ("length", "stop") and queued.finished.error is None
        (after,) = solo(engine, [request(p, 6, sampling=SAMPLED)])
        assert after.reason in ("length", "stop") and after.finished.error is None


def test_a_short_request_starts_while_long_prompts_prefill(lm):
    """Two long prompts fill the prefill pacing; a short request arriving after them gets
    its first token before either long one has produced anything."""
    model, tokenizer = lm
    longs = [tokens(tokenizer, 1500, 10 + i) for i in range(2)]
    short = tokens(tokenizer, 6, 20)
    with running_engine(
        model, tokenizer, prefill_step_size=32, max_batch_size=4, prompt_cache_size=0
    ) as engine:
        order: list[str] = []

        async def first_token(name: str, handle) -> None:
            async for ev in handle:
                if isinstance(ev, TokenPiece | Finished):
                    order.append(name)
                    break
            async for _ in handle:
                pass

        async def run():
            hs = [engine.submit(request(p, 4)) for p in longs]
            # Wait until both long prompts are prefilling before the short one arrives.
            for _ in range(10_000):
                if engine.stats()["prefilling"] == 2:
                    break
                await asyncio.sleep(0.002)
            assert engine.stats()["prefilling"] == 2
            hs.append(engine.submit(request(short, 4)))
            await asyncio.gather(*(first_token(n, h) for n, h in zip("ABS", hs, strict=True)))

        drive(engine, run())
        assert order[0] == "S", order


def test_a_consumer_that_fell_behind_reads_the_first_token_then_the_end(lm):
    """The reading pattern above on a loop that fell behind (a loaded machine): every
    event of the request waits in its handle, the first text piece merges the rest, and
    the loop reading on after it still gets the end."""
    model, tokenizer = lm
    with running_engine(model, tokenizer, prompt_cache_size=0) as engine:

        async def run():
            handle = engine.submit(request(tokens(tokenizer, 6, 21), 4, ignore_eos=True))
            assert isinstance(await handle.next_event(), Started)  # it runs now
            await until(lambda: engine.active_count == 0, "the request to end")
            # Blocks the loop on purpose: the engine's last flush is behind this call.
            engine.call(lambda: None).result(timeout=60)
            await asyncio.sleep(0)  # the deliveries it scheduled run before this task
            async for ev in handle:
                if isinstance(ev, TokenPiece):
                    break
            return [ev async for ev in handle]

        rest = drive(engine, run(), timeout=30)
        assert [type(ev) for ev in rest] == [Finished] and rest[0].reason == "length"


def test_generate_after_faults_is_deterministic(lm):
    """A fault resets only the global random state: seeded requests are unaffected."""
    model, tokenizer = lm
    p = tokens(tokenizer, 8, 6)
    seeded = SamplingParams(temperature=1.0, seed=7)
    with running_engine(model, tokenizer) as engine:
        before = drive(engine, generate(engine, request(p, 10, sampling=seeded)))
        wide = SamplingParams(temperature=1.0, top_k=vocab_width(model))
        solo(engine, [request(p, 4, sampling=wide)])
        after = drive(engine, generate(engine, request(p, 10, sampling=seeded)))
        assert before.text == after.text and after.finished.error is None
