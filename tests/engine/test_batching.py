"""Continuous batching on the real engine: concurrent sequences keep their own parameters and
results, join after their prefill, and leave when finished or cancelled."""

from __future__ import annotations

import asyncio
import random
import re

import pytest
from engine_runner import (
    collect,
    drive,
    generate_all,
    load_varied_model,
    request,
    running_engine,
    solo,
    until,
)

from mlx_server.engine.core.handle import Started, TokenPiece
from mlx_server.types import SamplingParams

WORDS = "the quick brown fox jumps over lazy dog hello world paris capital of france".split()


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    model, tokenizer, _ = load_varied_model(tmp_path_factory)
    return model, tokenizer


def prompt(tokenizer, n_words: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return list(tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(n_words))))


def ascii_stop(text: str) -> str | None:
    """A short stop string whose first occurrence in ``text`` is well into it."""
    for m in re.finditer(r"[A-Za-z0-9]{2}", text):
        if text.index(m.group(0)) >= 12:
            return m.group(0)
    return None


def stop_probe(engine, tokenizer) -> tuple[list[int], str, str]:
    """A prompt whose greedy answer has a usable stop string: (prompt, stop, answer)."""
    for seed in range(40):
        p = prompt(tokenizer, 4 + 9 * 4, seed=seed)
        (r,) = solo(engine, [request(p, 24)])
        stop = ascii_stop(r.text)
        if stop is not None:
            return p, stop, r.text
    raise AssertionError("no prompt with a usable stop string")


def six_requests(tokenizer, stop_prompt: list[int], stop: str) -> list:
    p = [prompt(tokenizer, 4 + 9 * i, seed=i) for i in range(6)]
    p[4] = stop_prompt
    return [
        request(p[0], 24),
        request(p[1], 7),
        request(p[2], 24, sampling=SamplingParams(temperature=0.9, top_p=0.9, seed=11)),
        request(
            p[3],
            24,
            sampling=SamplingParams(temperature=0.7, top_k=20, repetition_penalty=1.3, seed=5),
        ),
        request(p[4], 24, stop=(stop,)),
        request(p[5], 16, logprobs=True, top_logprobs=3),
    ]


def test_six_concurrent_requests_each_get_their_own_result(lm):
    model, tokenizer = lm
    with running_engine(model, tokenizer, prompt_cache_size=0) as engine:
        stop_prompt, stop, probe = stop_probe(engine, tokenizer)
        (greedy2,) = solo(engine, [request(prompt(tokenizer, 22, seed=2), 24)])
        alone = solo(engine, six_requests(tokenizer, stop_prompt, stop))
        together = drive(engine, generate_all(engine, six_requests(tokenizer, stop_prompt, stop)))

    for a, b in zip(alone, together, strict=True):
        assert b.text == a.text
        assert b.reason == a.reason
        assert b.finished.usage.completion_tokens == a.finished.usage.completion_tokens
    assert together[1].reason == "length"
    assert together[1].finished.usage.completion_tokens == 7
    stopped = together[4]
    assert stopped.reason == "stop_sequence"
    assert stopped.finished.usage.completion_tokens > 1
    assert stopped.finished.stop_sequence == stop
    assert stop not in stopped.text
    assert stopped.text == probe[: probe.index(stop)]
    # Sampled sequences really sampled: they differ from greedy decoding of the same prompt.
    assert together[2].text != greedy2.text
    with_lp = together[5]
    assert len(with_lp.logprobs) == with_lp.finished.usage.completion_tokens == 16
    for x, y in zip(with_lp.logprobs, alone[5].logprobs, strict=True):
        assert x.token == y.token
        assert abs(x.logprob - y.logprob) < 1e-3
        assert len(x.top) == 3
        assert x.top[0].logprob >= x.top[-1].logprob


def test_staggered_joins_match_solo_results(lm):
    model, tokenizer = lm
    prompts = [prompt(tokenizer, 3 + 11 * i, seed=100 + i) for i in range(6)]
    with running_engine(model, tokenizer, prompt_cache_size=0) as engine:
        alone = solo(engine, [request(p, 20 + i) for i, p in enumerate(prompts)])

        async def staggered():
            handles = []
            for i, p in enumerate(prompts):
                handles.append(asyncio.ensure_future(collect(engine.submit(request(p, 20 + i)))))
                await asyncio.sleep(0.005 * i)
            return await asyncio.gather(*handles)

        joined = drive(engine, staggered())
        assert engine.active_count == 0 and engine.queue_depth == 0
    assert [r.text for r in joined] == [r.text for r in alone]
    assert [r.finished.usage.completion_tokens for r in joined] == [20 + i for i in range(6)]


def test_long_prompt_is_prefilled_in_chunks_while_others_decode(lm):
    model, tokenizer = lm
    long_prompt = prompt(tokenizer, 300, seed=7)
    short_prompt = prompt(tokenizer, 5, seed=8)
    assert len(long_prompt) > 200
    order: list[str] = []

    async def run(engine):
        async def consume(handle, name):
            async for ev in handle:  # noqa: B007 - the last event is the Finished one
                if not isinstance(ev, Started):  # the start comes before the prefill
                    order.append(name)
            return ev

        first = engine.submit(request(short_prompt, 80))
        runner = asyncio.ensure_future(consume(first, "running"))
        await until(lambda: "running" in order, "the first request's first token")
        order.append("submitted")
        joiner = await consume(engine.submit(request(long_prompt, 4)), "joiner")
        return await runner, joiner

    with running_engine(model, tokenizer, prompt_cache_size=0, prefill_step_size=16) as engine:
        running, joiner = drive(engine, run(engine))
        (alone,) = solo(engine, [request(long_prompt, 4)])
    assert running.reason == joiner.reason == "length"
    # Between the join and the joiner's first token the running stream kept producing:
    # the long prompt went in 16-token chunks, one per decode step.
    window = order[order.index("submitted") : order.index("joiner")]
    assert window.count("running") >= 8, order
    assert joiner.usage.prompt_tokens == alone.finished.usage.prompt_tokens


def test_cancelling_one_sequence_leaves_the_others_unharmed(lm):
    model, tokenizer = lm
    prompts = [prompt(tokenizer, 6 + 5 * i, seed=200 + i) for i in range(4)]

    async def run(engine):
        handles = [engine.submit(request(p, 40)) for p in prompts]
        victim = handles[1]
        results = {}

        async def consume(i, h):
            pieces = 0
            async for ev in h:  # noqa: B007 - the last event is the Finished one
                pieces += 1
                if h is victim and pieces == 3:
                    h.cancel()
            results[i] = ev

        await asyncio.gather(*(consume(i, h) for i, h in enumerate(handles)))
        # The engine-level cancel by id works the same way.
        other = engine.submit(request(prompts[0], 200))
        task = asyncio.ensure_future(collect(other))
        await until(lambda: engine.active_count, "the request to run")  # not just queued
        assert engine.cancel(other.request_id) == 1
        return [results[i] for i in range(4)], await task

    with running_engine(model, tokenizer, prompt_cache_size=0) as engine:
        alone = solo(engine, [request(p, 40) for p in prompts])
        results, by_id = drive(engine, run(engine))
        assert engine.active_count == 0 and engine.queue_depth == 0
        (after,) = solo(engine, [request(prompts[2], 40)])
    assert results[1].reason == "cancelled"
    assert results[1].usage.completion_tokens < 40
    assert by_id.reason == "cancelled"
    for i in (0, 2, 3):
        assert results[i].reason == "length"
        assert results[i].usage.completion_tokens == 40
    assert after.text == alone[2].text


def test_batch_size_limit_bounds_concurrency(lm):
    model, tokenizer = lm
    prompts = [prompt(tokenizer, 4 + 3 * i, seed=300 + i) for i in range(5)]
    seen: list[int] = []

    async def run(engine):
        async def consume(h):
            text = ""
            async for ev in h:
                seen.append(engine.active_count)
                text += getattr(ev, "text", "")
            return text, ev.reason

        handles = [engine.submit(request(p, 16)) for p in prompts]
        return await asyncio.gather(*(consume(h) for h in handles))

    with running_engine(model, tokenizer, prompt_cache_size=0, max_batch_size=2) as engine:
        alone = solo(engine, [request(p, 16) for p in prompts])
        finished = drive(engine, run(engine))
    assert max(seen) <= 2
    assert finished == [(a.text, "length") for a in alone]


@pytest.mark.timeout(420)  # long prompts given up to 300 s to finish
def test_prefill_is_paced_so_long_prompts_do_not_pile_up(lm):
    model, tokenizer = lm
    longs = [prompt(tokenizer, 120, seed=400 + i) for i in range(4)]
    short = prompt(tokenizer, 3, seed=500)
    seen: list[int] = []

    async def run(engine):
        running = asyncio.ensure_future(collect(engine.submit(request(short, 120))))
        await until(
            lambda: not engine.stats()["prefilling"] and engine.active_count,
            "the short request to decode",
        )
        handles = [engine.submit(request(p, 6)) for p in longs]
        tasks = asyncio.gather(*(collect(h) for h in handles))

        def sample_until_done() -> bool:
            if tasks.done():
                return True
            seen.append(engine.stats()["next_prefill_tokens"])
            return False

        await until(sample_until_done, "the long prompts to finish", timeout=300)
        await running
        return tasks.result()

    with running_engine(model, tokenizer, prompt_cache_size=0, prefill_step_size=16) as engine:
        alone = solo(engine, [request(p, 6) for p in longs])
        paced = drive(engine, run(engine))
    # Four long prompts in 16-token chunks: two share a step, never more than two chunks' worth.
    assert 16 < max(seen) <= 32
    assert [r.text for r in paced] == [a.text for a in alone]


def test_a_lone_stream_keeps_its_text_when_others_join_it(lm):
    """A request alone runs outside the batch; requests arriving while it prefills or
    decodes move it into the batch, and every text (sampled with a seed or greedy) is what
    the request gives alone."""
    model, tokenizer = lm
    first = prompt(tokenizer, 120, seed=300)
    others = [prompt(tokenizer, 6 + 5 * i, seed=301 + i) for i in range(3)]
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=42)
    with running_engine(
        model, tokenizer, prompt_cache_size=0, prefill_step_size=16, max_batch_size=4
    ) as engine:
        (alone,) = solo(engine, [request(first, 40, sampling=seeded)])
        rest = solo(engine, [request(p, 12) for p in others])

        async def join(after_tokens: int):
            lead = engine.submit(request(first, 40, sampling=seeded))
            text, seen = "", 0
            joined = []
            async for ev in lead:
                if isinstance(ev, Started):
                    continue
                if isinstance(ev, TokenPiece):
                    text += ev.text
                    seen += 1
                    if seen == after_tokens:
                        joined = [
                            asyncio.ensure_future(collect(engine.submit(request(p, 12))))
                            for p in others
                        ]
                else:
                    return ev, text, await asyncio.gather(*joined)
            raise AssertionError("no Finished")

        for after in (1, 5):
            fin, text, joined = drive(engine, join(after))
            assert fin.reason == alone.reason and text == alone.text
            assert fin.usage.completion_tokens == alone.finished.usage.completion_tokens
            assert [r.text for r in joined] == [r.text for r in rest]

        # Joining while the lone prompt is still being prefilled (chunks of 16 tokens).
        async def join_in_prefill():
            lead = asyncio.ensure_future(
                collect(engine.submit(request(first, 40, sampling=seeded)))
            )
            # Admitted alone; its prefill takes 8+ steps.
            await until(lambda: engine.active_count, "the lone request to be admitted")
            more = [asyncio.ensure_future(collect(engine.submit(request(p, 12)))) for p in others]
            return await lead, await asyncio.gather(*more)

        lead, joined = drive(engine, join_in_prefill())
        assert lead.text == alone.text and [r.text for r in joined] == [r.text for r in rest]
        assert engine.active_count == 0 and engine.queue_depth == 0
