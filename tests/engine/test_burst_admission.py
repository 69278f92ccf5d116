"""Requests that arrive together start together: a request announced to the engine
(``Engine.expect``, as the chat service does before it renders a prompt) holds the queued
ones back until it is queued or withdrawn, so a burst prefills as one batch instead of its
first request starting alone and the rest joining in waves. A lone request is never held."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from engine_runner import collect, drive, load_varied_model, request, running_engine

from mlx_server.protocols.openai.chat.adapter import to_chat_request
from mlx_server.protocols.openai.chat.schemas import ChatCompletionRequest
from mlx_server.service import ChatService

pytestmark = pytest.mark.tiny

FOREVER = 600.0  # a hold that would outlast every deadline below


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    model, tokenizer, _ = load_varied_model(tmp_path_factory)
    return model, tokenizer


def prompt(tokenizer, i: int) -> list[int]:
    return list(tokenizer.encode(f"request {i}: the quick brown fox jumps"))


def count_admissions(engine, monkeypatch) -> Callable[[], int]:
    """How many times the engine thread has tried to start the queued requests."""
    done = 0
    admit = engine._admit

    def counted() -> None:
        nonlocal done
        admit()
        done += 1

    monkeypatch.setattr(engine, "_admit", counted)
    return lambda: done


async def engine_tried_to_start_the_queue(engine, admissions: Callable[[], int]) -> None:
    """Wait until the engine thread has tried to start what is queued now: a call wakes it,
    reads the count on the engine thread, and the admission that follows the call in the
    engine's loop has seen the queue."""
    before = await asyncio.wait_for(asyncio.wrap_future(engine.call(admissions)), 60)
    deadline = time.monotonic() + 60
    while admissions() == before:
        assert time.monotonic() < deadline, "the engine thread never tried to admit"
        await asyncio.sleep(0.01)


def test_announced_requests_start_together(lm, monkeypatch):
    model, tokenizer = lm
    with running_engine(model, tokenizer, gather_s=FOREVER, prompt_cache_size=0) as engine:
        admissions = count_admissions(engine, monkeypatch)
        reqs = [request(prompt(tokenizer, i), 6, ignore_eos=True) for i in range(3)]
        for r in reqs:
            engine.expect(r.request_id)

        async def run() -> list:
            first = engine.submit(reqs[0])
            await engine_tried_to_start_the_queue(engine, admissions)
            assert engine.stats()["queued"] == 1  # held for the announced ones
            rest = [engine.submit(r) for r in reqs[1:]]
            return list(await asyncio.wait_for(asyncio.gather(*map(collect, [first, *rest])), 120))

        results = drive(engine, run())
        assert [r.reason for r in results] == ["length"] * 3
        assert engine.stats()["solo_runs"] == 0  # none ran on the lone path: one batch


def test_a_lone_announced_request_is_not_held(lm):
    model, tokenizer = lm
    with running_engine(model, tokenizer, gather_s=FOREVER, prompt_cache_size=0) as engine:
        req = request(prompt(tokenizer, 0), 4, ignore_eos=True)
        engine.expect(req.request_id)

        async def run():
            return await asyncio.wait_for(collect(engine.submit(req)), 120)

        assert drive(engine, run()).reason == "length"
        assert engine.stats()["solo_runs"] == 1


def test_a_withdrawn_announcement_releases_the_queue(lm, monkeypatch):
    model, tokenizer = lm
    with running_engine(model, tokenizer, gather_s=FOREVER, prompt_cache_size=0) as engine:
        admissions = count_admissions(engine, monkeypatch)
        req = request(prompt(tokenizer, 0), 4, ignore_eos=True)
        engine.expect(req.request_id)
        withdraw = engine.expect("never-submitted")  # its prompt failed to build, say

        async def run():
            handle = engine.submit(req)
            await engine_tried_to_start_the_queue(engine, admissions)
            assert engine.stats()["queued"] == 1  # held for the announced one
            withdraw()
            return await asyncio.wait_for(collect(handle), 120)

        assert drive(engine, run()).reason == "length"


def test_the_chat_service_announces_what_it_renders(lm):
    """Chat requests started together reach the engine as one batch."""
    model, tokenizer = lm
    with running_engine(model, tokenizer, gather_s=FOREVER, prompt_cache_size=0) as engine:
        service = ChatService("m", tokenizer, engine, ctx_size=2048)
        body = {"model": "m", "max_tokens": 4, "ignore_eos": True, "temperature": 0}

        async def run() -> list:
            chats = [
                to_chat_request(
                    ChatCompletionRequest.model_validate(
                        {**body, "messages": [{"role": "user", "content": f"hello {i}"}]}
                    )
                )
                for i in range(4)
            ]
            gens = await asyncio.gather(*(service.start(c) for c in chats))

            async def drain(gen) -> int:
                n = 0
                async for ev in gen.events():
                    n = getattr(getattr(ev, "usage", None), "completion_tokens", n)
                return n

            return list(await asyncio.wait_for(asyncio.gather(*map(drain, gens)), 120))

        assert drive(engine, run()) == [4, 4, 4, 4]
        assert engine.stats()["solo_runs"] == 0
        assert not engine._sched.expected  # every announcement ended with its request
