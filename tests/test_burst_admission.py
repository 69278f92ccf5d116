"""Requests that arrive together start together: a request announced to the engine
(``Engine.expect``, as the chat service does before it renders a prompt) holds the queued
ones back until it is queued or withdrawn, so a burst prefills as one batch instead of its
first request starting alone and the rest joining in waves. A lone request is never held."""

from __future__ import annotations

import asyncio

import pytest
from engine_runner import collect, load_varied_model, request, running_engine

from mlx_server.protocols.openai.adapter import to_chat_request
from mlx_server.protocols.openai.schemas import ChatCompletionRequest
from mlx_server.service import ChatService

pytestmark = pytest.mark.tiny

FOREVER = 600.0  # a hold that would outlast every deadline below


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    model, tokenizer, _ = load_varied_model(tmp_path_factory)
    return model, tokenizer


def prompt(tokenizer, i: int) -> list[int]:
    return list(tokenizer.encode(f"request {i}: the quick brown fox jumps"))


def test_announced_requests_start_together(lm):
    model, tokenizer = lm
    with running_engine(model, tokenizer, gather_s=FOREVER, prompt_cache_size=0) as engine:
        reqs = [request(prompt(tokenizer, i), 6, ignore_eos=True) for i in range(3)]
        for r in reqs:
            engine.expect(r.request_id)

        async def run() -> list:
            first = engine.submit(reqs[0])
            await asyncio.sleep(0.1)  # time enough to start it alone, were it not held
            rest = [engine.submit(r) for r in reqs[1:]]
            return list(await asyncio.wait_for(asyncio.gather(*map(collect, [first, *rest])), 120))

        results = asyncio.run(run())
        assert [r.reason for r in results] == ["length"] * 3
        assert engine.stats()["solo_runs"] == 0  # none ran on the lone path: one batch


def test_a_lone_announced_request_is_not_held(lm):
    model, tokenizer = lm
    with running_engine(model, tokenizer, gather_s=FOREVER, prompt_cache_size=0) as engine:
        req = request(prompt(tokenizer, 0), 4, ignore_eos=True)
        engine.expect(req.request_id)

        async def run():
            return await asyncio.wait_for(collect(engine.submit(req)), 120)

        assert asyncio.run(run()).reason == "length"
        assert engine.stats()["solo_runs"] == 1


def test_a_withdrawn_announcement_releases_the_queue(lm):
    model, tokenizer = lm
    with running_engine(model, tokenizer, gather_s=FOREVER, prompt_cache_size=0) as engine:
        req = request(prompt(tokenizer, 0), 4, ignore_eos=True)
        engine.expect(req.request_id)
        withdraw = engine.expect("never-submitted")  # its prompt failed to build, say

        async def run():
            handle = engine.submit(req)
            await asyncio.sleep(0.1)
            withdraw()
            return await asyncio.wait_for(collect(handle), 120)

        assert asyncio.run(run()).reason == "length"


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

        assert asyncio.run(run()) == [4, 4, 4, 4]
        assert engine.stats()["solo_runs"] == 0
        assert not engine._sched.expected  # every announcement ended with its request
