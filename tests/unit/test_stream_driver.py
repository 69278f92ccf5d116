"""The stream driver's hot path: content chunks made from a template are the bytes the
dictionary would serialise to, and ``EventStream`` keeps its promises (chunks in order,
keep-alives only in silence and never inside a write, a client that leaves closes the body
at once, wherever the writer waits) while reading the body in the writing task itself."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from mlx_server.engine.core.handle import Started
from mlx_server.events import ReasoningDelta, TextDelta
from mlx_server.protocols.anthropic.encoder import MessagesEncoder, frames
from mlx_server.protocols.anthropic.stream import StreamEncoder
from mlx_server.protocols.openai.chat.chunks import ChunkEncoder
from mlx_server.protocols.openai.chat.encoder import ChatEncoder, ChoicesEncoder
from mlx_server.server.event_stream import EventStream
from mlx_server.server.sse import encode

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


def test_an_anthropic_text_delta_is_the_dictionary_serialised():
    """``MessagesEncoder``'s text deltas (from a template per block) are the bytes of the
    events ``StreamEncoder.event`` makes, in the first text block and in one after a
    thinking block; the first piece of a block still opens it."""
    plain = StreamEncoder("msg_1", "m", 5)  # the reference: dictionaries
    fast = MessagesEncoder(StreamEncoder("msg_1", "m", 5))
    fast.open(collect=False)
    fast.start(0, Started(0))
    plain.start()
    pieces = [TextDelta(t) for t in TEXTS] + [ReasoningDelta("hm")]
    for ev in pieces + [TextDelta(t) for t in reversed(TEXTS)]:
        want = [encode(f) for f in frames(plain.event(ev))]
        assert [encode(f) for f in fast.event(0, ev)] == want, ev

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


async def source(items: list[bytes], gaps: list[float], closed: list[bool]) -> AsyncIterator[bytes]:
    try:
        for item, gap in zip(items, gaps, strict=True):
            await asyncio.sleep(gap)
            yield item
    finally:
        closed.append(True)


KEEPALIVE = b": keep-alive\n\n"


class Client:
    """An ASGI peer: records the body's chunks; ``slow_s``: each write of a chunk other than
    a keep-alive takes that long (a client that reads slowly); ``leave``: set to disconnect."""

    def __init__(self, slow_s: float = 0.0):
        self.chunks: list[bytes] = []
        self.ended = False
        self.slow_s = slow_s
        self.writing = 0  # writes under way at once
        self.overlapped = False
        self.leave = asyncio.Event()

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] != "http.response.body":
            return
        self.writing += 1
        self.overlapped |= self.writing > 1
        try:
            if self.slow_s and message["body"] not in (KEEPALIVE, b""):
                await asyncio.sleep(self.slow_s)
            if message["body"]:
                self.chunks.append(message["body"])
            self.ended |= not message["more_body"]
        finally:
            self.writing -= 1

    async def receive(self) -> dict[str, Any]:
        await self.leave.wait()
        return {"type": "http.disconnect"}


async def respond(body: AsyncIterator[bytes], client: Client, interval: float) -> None:
    response = EventStream(
        body, keepalive=lambda: KEEPALIVE, keepalive_s=interval, media_type="text/event-stream"
    )
    await response({"type": "http"}, client.receive, client.send)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_chunks_in_order_and_keepalives_only_in_silence():
    closed: list[bool] = []
    client = Client()

    async def main() -> None:
        task = asyncio.ensure_future(
            respond(source([b"a", b"b", b"c"], [0, 1.0, 0], closed), client, 0.2)
        )
        deadline = asyncio.get_running_loop().time() + 10
        while not client.ended:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        client.leave.set()  # the server closes after the last chunk
        await task

    run(main())
    got = client.chunks
    assert [x for x in got if x != KEEPALIVE] == [b"a", b"b", b"c"]
    assert got[0] == b"a" and got[-2:] == [b"b", b"c"]  # the silence was between a and b
    assert got.count(KEEPALIVE) >= 2 and closed == [True]


def test_no_keepalive_inside_a_slow_write():
    """A client that takes longer than the interval to take each chunk gets no keep-alive
    in the middle of one (the writes never overlap)."""
    closed: list[bool] = []
    client = Client(slow_s=0.3)

    async def main() -> None:
        task = asyncio.ensure_future(respond(source([b"a", b"b"], [0, 0], closed), client, 0.1))
        deadline = asyncio.get_running_loop().time() + 10
        while not client.ended:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        client.leave.set()
        await task

    run(main())
    assert not client.overlapped
    assert [x for x in client.chunks if x != KEEPALIVE] == [b"a", b"b"] and closed == [True]


@pytest.mark.parametrize("waiting", [False, True], ids=["in-a-write", "inside-the-body"])
def test_a_client_that_leaves_closes_the_body(waiting):
    closed: list[bool] = []
    client = Client(slow_s=0 if waiting else 10)

    async def main() -> None:
        gaps = [0, 10 if waiting else 0, 0]
        task = asyncio.ensure_future(respond(source([b"a", b"b", b"c"], gaps, closed), client, 5))
        deadline = asyncio.get_running_loop().time() + 10
        while client.writing == 0 and not client.chunks:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the writer waits inside the body, or in its write
        client.leave.set()
        await task

    run(main())
    assert closed == [True] and not client.ended
