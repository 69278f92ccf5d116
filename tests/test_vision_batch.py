"""Vision requests in the continuous batch and the prefix cache, through the chat service
on the tiny Idefics3 (a Llama language model): requests with images and text-only ones
decode together, the same image in the next turn is served from the cache and a different
one is not, and cancelling one leaves the others running."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from engine_runner import until
from test_vision_service import ask, chat, image
from tiny_vlm import build_tiny_idefics3

from mlx_server.engine.core.engine import EngineConfig
from mlx_server.engine.runners.vision import VisionEngine
from mlx_server.events import Finished, TextDelta
from mlx_server.models.loader import load_model
from mlx_server.models.media import MediaLimits
from mlx_server.models.vision import VisionPromptBuilder
from mlx_server.service import ChatService

RED, BLUE = (255, 0, 0), (0, 0, 255)


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Any:
    loaded = load_model(str(build_tiny_idefics3(tmp_path_factory.mktemp("vlm") / "idefics3")))
    # gather_s: requests started together are admitted together (no wave depends on timing).
    config = EngineConfig(kv_bytes_per_token=256, gather_s=10.0)
    engine = VisionEngine(loaded.model, loaded.tokenizer, config)
    assert engine.serial_reason == ""
    vision = VisionPromptBuilder(loaded.processor, loaded.config, MediaLimits())
    svc = ChatService(loaded.model_id, loaded.tokenizer, engine, ctx_size=4096, vision=vision)
    engine.start()
    yield svc
    engine.shutdown(timeout=10)


async def finish(gen: Any) -> tuple[str, Finished]:
    text, final = "", None
    async for ev in gen.events():
        if isinstance(ev, TextDelta):
            text += ev.text
        elif isinstance(ev, Finished):
            final = ev
    assert final is not None
    return text, final


def run_all(service: ChatService, *reqs: Any) -> list[tuple[str, Finished]]:
    async def main():
        gens = await asyncio.gather(*(service.start(r) for r in reqs))
        return await asyncio.gather(*(finish(g) for g in gens))

    return asyncio.run(main())


def test_images_and_text_decode_in_one_batch(service):
    engine = service.engine
    before = engine.stats()["vision_prefills"]
    reqs = [
        chat(ask(image(RED)), max_tokens=12, ignore_eos=True),
        chat(ask(image(BLUE), text="And this one?"), max_tokens=12, ignore_eos=True),
        chat(ask(text="No picture today."), max_tokens=12, ignore_eos=True),
    ]
    results = run_all(service, *reqs)
    assert [f.reason for _, f in results] == ["length"] * 3
    assert [f.usage.completion_tokens for _, f in results] == [12] * 3
    stats = engine.stats()
    assert stats["mode"] == "batch"
    assert stats["vision_prefills"] == before + 2  # the text-only one took the text path
    assert stats["peak_batch"] >= 3  # all three decoded together
    # Batched, each request is what it is alone (greedy): the images reached the model.
    alone = run_all(service, reqs[0])[0]
    assert alone[0] == results[0][0] and results[0][0] != results[1][0]


def test_the_same_image_next_turn_is_cached_and_a_different_one_is_not(service):
    first = chat(ask(image((0, 120, 0)), text="Turn one."), max_tokens=6, ignore_eos=True)
    text, done = run_all(service, first)[0]
    n1 = done.usage.prompt_tokens
    assert done.usage.cached_tokens < 20  # at most the text before the image

    def turn_two(color):
        messages = [ask(image(color), text="Turn one."), {"role": "assistant", "content": text}]
        return chat(*messages, ask(text="Turn two."), max_tokens=4, ignore_eos=True)

    _, same = run_all(service, turn_two((0, 120, 0)))[0]
    assert same.usage.cached_tokens >= n1 - 1  # turn one's prompt (and answer) from the cache
    _, other = run_all(service, turn_two((120, 0, 120)))[0]
    # Only the text before the image: the image's tokens and all after them are prefilled.
    assert 0 < other.usage.cached_tokens < 20
    assert same.reason == other.reason == "length"


def test_cancelling_one_leaves_the_others_running(service):
    engine = service.engine
    long = chat(ask(image(RED)), max_tokens=4000, ignore_eos=True)
    short = chat(ask(image(BLUE)), max_tokens=24, ignore_eos=True)

    async def main():
        g_long, g_short = await asyncio.gather(service.start(long), service.start(short))
        t_short = asyncio.ensure_future(finish(g_short))
        seen = []

        async def read_long():
            async for ev in g_long.events():
                if isinstance(ev, TextDelta):
                    seen.append(ev)
                if isinstance(ev, Finished):
                    return ev

        t_long = asyncio.ensure_future(read_long())
        await until(lambda: seen, "the long request's first tokens")
        assert engine.cancel(g_long.request_id) == 1
        return await t_long, await t_short

    f_long, (_, f_short) = asyncio.run(main())
    assert f_long.reason == "cancelled" and f_long.usage.completion_tokens < 4000
    assert f_short.reason == "length" and f_short.usage.completion_tokens == 24
    assert engine.active_count == 0
