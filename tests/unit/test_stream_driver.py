"""The stream driver's hot path: content chunks made from a template are the bytes the
dictionary would serialise to, and ``with_keepalive`` keeps its promises (items in order,
keep-alives only in silence, errors passed on, closing closes the source) while reading the
source through one task."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from mlx_server.events import TextDelta
from mlx_server.protocols.openai.chat.encoder import ChatEncoder, ChoicesEncoder, ChunkEncoder
from mlx_server.server.sse import encode
from mlx_server.server.streaming import with_keepalive

pytestmark = pytest.mark.tiny

TEXTS = ["hi", "", " two words", 'quo"te \\ back', "é 中文 🙂", "\x00\x1f\n\t", "\u2028\u2029"]


@pytest.mark.parametrize("text", TEXTS)
def test_a_content_chunk_is_the_dictionary_serialised(text):
    enc = ChunkEncoder('chatcmpl-"x"', "models/a\\b", index=3)
    want = json.dumps(enc._chunk({"content": text}), ensure_ascii=False).encode()
    assert enc.content(text).text == want
    assert json.loads(want)["choices"][0] == {
        "index": 3,
        "delta": {"content": text},
        "finish_reason": None,
    }


def test_every_choice_streams_its_own_index():
    enc = ChoicesEncoder("id", "m", include_usage=False, want_logprobs=False, n=3)
    role = [json.loads(encode(f)[len(b"data: ") :]) for f in enc.open(collect=False)]
    assert [r["choices"][0]["index"] for r in role] == [0, 1, 2]
    for i in range(3):
        (frame,) = enc.event(i, TextDelta(f"t{i}"))
        data = json.loads(encode(frame)[len(b"data: ") :])
        assert (
            data["choices"][0]["index"] == i and data["choices"][0]["delta"]["content"] == f"t{i}"
        )
    single = ChatEncoder("id", "m", include_usage=False, want_logprobs=False)
    single.open(collect=False)
    assert single.event(0, TextDelta("")) == []
    single.open(collect=True)  # a collected answer makes no frames
    assert single.event(0, TextDelta("kept")) == [] and single.builder.content == ["kept"]


async def source(
    items: list[object], gaps: list[float], closed: list[bool]
) -> AsyncIterator[object]:
    try:
        for item, gap in zip(items, gaps, strict=True):
            await asyncio.sleep(gap)
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        closed.append(True)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_items_in_order_and_keepalives_only_in_silence():
    closed: list[bool] = []

    async def main() -> list[object]:
        got = []
        async for x in with_keepalive(source(["a", "b", "c"], [0, 1.0, 0], closed), 0.2):
            got.append(x)
        return got

    got = run(main())
    assert [x for x in got if x is not None] == ["a", "b", "c"]
    assert got[0] == "a" and got[-2:] == ["b", "c"]  # the silence was between a and b
    assert got.count(None) >= 2 and closed == [True]


def test_an_error_in_the_source_reaches_the_consumer():
    closed: list[bool] = []

    async def main() -> list[object]:
        got = []
        with pytest.raises(ValueError, match="broken"):
            async for x in with_keepalive(source(["a", ValueError("broken")], [0, 0], closed), 5):
                got.append(x)
        return got

    assert run(main()) == ["a"] and closed == [True]


@pytest.mark.parametrize("waiting", [False, True], ids=["at-a-yield", "inside-the-source"])
def test_closing_early_closes_the_source(waiting):
    closed: list[bool] = []

    async def main() -> None:
        gaps = [0, 10 if waiting else 0, 0]
        stream = with_keepalive(source(["a", "b", "c"], gaps, closed), 5)
        assert await anext(stream) == "a"
        await asyncio.sleep(0.05)  # the reader waits at its slot, or inside the source
        await stream.aclose()

    run(main())
    assert closed == [True]
