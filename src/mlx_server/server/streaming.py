"""Every generating route's ending: stream the generation as SSE (or NDJSON), or collect
it into one JSON answer, through the protocol's ``Encoder``.

The driver owns what the protocols share: keep-alive frames while nothing comes (a long
prompt's prefill can take minutes; clients and proxies drop a connection that stays quiet),
a failure after the 200 went out (the protocol's error event and Jan's ``error:`` line), a
client that leaves (the generation is cancelled; 499 for a collected answer).
"""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mlx_server.engine.core.handle import Started
from mlx_server.errors import ServerError
from mlx_server.events import Finished
from mlx_server.logs import log
from mlx_server.server.event_stream import EventStream
from mlx_server.server.framing import SSE, Framing
from mlx_server.server.sse import Frame

# Seconds of silence before a stream gets a keep-alive frame (Claude Code's HTTP client
# gives up after 5 minutes without a byte): the app factory's default.
KEEPALIVE_S = 15.0

T = TypeVar("T")


class Source(Protocol):
    """One generation: ``Started`` once the engine takes it up (it may queue first), then
    neutral events, ending with ``Finished`` (which may come without a start: a request
    cancelled while it waited)."""

    def events(self) -> AsyncIterator[Any]: ...

    def cancel(self) -> None: ...


class Encoder(Protocol):
    """A protocol's view of one response: the frames for each step of its generations, or
    the whole answer. Both forms run the same steps, so they carry the same content; a
    streamed one keeps nothing for an answer, a collected one makes no frames for events."""

    @property
    def keepalive(self) -> Frame:
        """The frame sent when the stream has been silent for a while."""
        ...

    def open(self, collect: bool) -> list[Frame]:
        """The frames a stream starts with, before any generation is taken up;
        ``collect``: the answer is collected (``result``), not streamed."""
        ...

    def start(self, index: int, started: Started) -> list[Frame]:
        """Generation ``index`` was taken up; ``started`` says how much of its prompt the
        prefix cache covered."""
        ...

    def event(self, index: int, ev: Any) -> list[Frame]:
        """A stream's frames for one event of generation ``index``; when collecting, the
        event is kept for the answer and no frames are made."""
        ...

    def finish(self, index: int, fin: Finished) -> list[Frame]:
        """Generation ``index`` ended (never with reason ``error``: see ``fail``)."""
        ...

    def end(self) -> list[Frame]:
        """After every generation finished."""
        ...

    def fail(self, message: str, fin: Finished | None) -> list[Frame]:
        """The protocol's error event(s) for a failure after the start; ``fin`` when the
        generation itself reported it."""
        ...

    def result(self) -> dict[str, Any]:
        """The collected answer."""
        ...


class GenerationFailed(Exception):
    def __init__(self, fin: Finished):
        super().__init__(fin.error or "generation failed")
        self.fin = fin


async def respond(
    request: Request,
    encoder: Encoder,
    sources: Sequence[Source],
    *,
    stream: bool,
    keepalive_s: float,
    on_end: Callable[[], None] | None = None,
    framing: Framing = SSE,
) -> Response:
    """A stream of ``encoder``'s frames (SSE unless ``framing`` says) if ``stream``, with a
    keep-alive frame after ``keepalive_s`` seconds of silence, else its collected answer.
    ``on_end`` runs once the response is over, however it ended."""
    if stream:
        encode = framing.encode
        return EventStream(
            _stream(encoder, sources, on_end, encode),
            keepalive=lambda: encode(encoder.keepalive),
            keepalive_s=keepalive_s,
            media_type=framing.media_type,
            headers=framing.headers,
        )
    result = await until_disconnect(
        request, _collect(encoder, sources, on_end), lambda: cancel_all(sources)
    )
    if result is None:
        log("Generation cancelled by client")
        return Response(status_code=499)
    return JSONResponse(result)


def cancel_all(sources: Sequence[Source]) -> None:
    for s in sources:
        s.cancel()


async def _steps(
    encoder: Encoder, sources: Sequence[Source], collect: bool
) -> AsyncGenerator[list[Frame], None]:
    yield encoder.open(collect)
    if len(sources) == 1:  # one generation: its events as they are, no merge
        events = sources[0].events()
        try:
            async for ev in events:
                yield _step(encoder, 0, ev)
        finally:
            await events.aclose()  # type: ignore[attr-defined]
    else:
        async for i, ev in merged(sources):
            yield _step(encoder, i, ev)
    yield encoder.end()


def _step(encoder: Encoder, i: int, ev: Any) -> list[Frame]:
    """The encoder's frames for event ``ev`` of generation ``i``."""
    if isinstance(ev, Started):
        return encoder.start(i, ev)
    if isinstance(ev, Finished):
        if ev.reason == "error":
            raise GenerationFailed(ev)
        if ev.reason == "cancelled":
            log("Stream generation cancelled")
        return encoder.finish(i, ev)
    return encoder.event(i, ev)


async def _collect(
    encoder: Encoder, sources: Sequence[Source], on_end: Callable[[], None] | None
) -> dict[str, Any]:
    try:
        try:
            async for _ in _steps(encoder, sources, collect=True):
                pass
        except GenerationFailed as e:
            encoder.fail(str(e), e.fin)
            raise ServerError(str(e)) from e
        return encoder.result()
    finally:
        if on_end is not None:
            on_end()


async def _stream(
    encoder: Encoder,
    sources: Sequence[Source],
    on_end: Callable[[], None] | None,
    encode: Callable[[Frame], bytes],
) -> AsyncIterator[bytes]:
    steps = _steps(encoder, sources, collect=False)
    try:
        async for frames in steps:  # one write per step of the generation
            if len(frames) == 1:  # the usual step: one chunk
                yield encode(frames[0])
            elif frames:
                yield b"".join([encode(frame) for frame in frames])
    except GenerationFailed as e:
        for frame in _failure(encoder, str(e), e.fin):
            yield encode(frame)
    except Exception as e:  # an internal fault after the 200 went out
        traceback.print_exc()
        log(f"Error in SSE stream: {type(e).__name__}: {e}")
        for frame in _failure(encoder, f"internal error: {type(e).__name__}", None):
            yield encode(frame)
    finally:
        await steps.aclose()
        if on_end is not None:
            on_end()


def _failure(encoder: Encoder, message: str, fin: Finished | None) -> list[Frame]:
    """Jan's ``error:`` line first (its reader stops there), then the protocol's own."""
    return [Frame(error=message), *encoder.fail(message, fin)]


async def merged(sources: Sequence[Source]) -> AsyncIterator[tuple[int, Any]]:
    """Events of the generations as they come, tagged with the generation's index.
    Closing the iterator early cancels every generation still running."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, source: Source) -> None:
        try:
            async for ev in source.events():
                queue.put_nowait((i, ev))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(sources)]
    left = len(sources)
    try:
        while left:
            i, ev = await queue.get()
            if ev is done:
                left -= 1
                continue
            yield i, ev
    finally:
        cancel_all(sources)
        for t in tasks:
            t.cancel()


async def until_disconnect(
    request: Request, work: Awaitable[T], on_disconnect: Callable[[], object]
) -> T | None:
    """Run ``work``; if the client disconnects first, call ``on_disconnect`` and return None."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        on_disconnect()
        await asyncio.wait({task})  # ended by on_disconnect (or cancelled by it)
        if not task.cancelled():
            task.exception()  # retrieved: the client is gone, nobody else will
        return None
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
