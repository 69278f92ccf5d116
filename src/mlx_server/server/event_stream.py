"""The streaming response every generating route answers with: the body's chunks written as
they come, a keep-alive chunk after a silence, and a client that leaves noticed at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import anyio
from starlette.responses import Response

_Send = Any  # ASGI's send callable


class EventStream(Response):
    """Writes ``body``'s chunks, and ``keepalive()`` each time ``keepalive_s`` seconds pass
    without a write (a long prompt's prefill can take minutes; clients and proxies drop a
    connection that stays quiet).

    The body is read by the writing task itself, and silence is watched by one timer per
    stream, re-armed from the time of the last write: no reader task, no queue and no wait
    per chunk, which at tens of streams of a fast model is much of the event loop's work. A
    keep-alive goes out from a task of its own only while the writer waits for the body,
    and the writer waits for it before its next write, so chunks never interleave.

    Starlette's own response listens for the disconnect only under servers older than ASGI
    2.4 (newer ones make it wait for a write to fail), and a stream may write nothing for a
    long time. Here a disconnect always cancels the writer at once, wherever it waits, and
    the body's own cleanup (a generation's frees its slot) runs."""

    def __init__(
        self,
        body: AsyncIterator[bytes],
        *,
        keepalive: Callable[[], bytes],
        keepalive_s: float,
        media_type: str,
        headers: Mapping[str, str] | None = None,
    ):
        self.chunks = body  # not ``body``: Response takes that for a length
        self.keepalive = keepalive
        self.keepalive_s = keepalive_s
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Any, receive: Any, send: _Send) -> None:
        async with anyio.create_task_group() as group:

            async def stream() -> None:
                try:
                    await self._write(send)
                except OSError:
                    pass  # the client went away while a chunk was written
                group.cancel_scope.cancel()

            group.start_soon(stream)
            while (await receive())["type"] != "http.disconnect":
                pass
            group.cancel_scope.cancel()

    async def _write(self, send: _Send) -> None:
        start = {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
        await send(start)
        quiet = _Silence(send, self.keepalive, self.keepalive_s)
        body = self.chunks
        try:
            async for chunk in body:
                if quiet.sending is not None:
                    await quiet.sending  # a keep-alive is on its way: after it
                quiet.writing = True
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                quiet.wrote()
            if quiet.sending is not None:
                await quiet.sending
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            quiet.close()
            await body.aclose()  # type: ignore[attr-defined]


class _Silence:
    """One stream's silence timer: after ``interval`` seconds without a write, and while
    no write is under way, send ``chunk()`` from a task of its own (``sending``)."""

    def __init__(self, send: _Send, chunk: Callable[[], bytes], interval: float):
        self.loop = asyncio.get_running_loop()
        self.send = send
        self.chunk = chunk
        self.interval = interval
        self.last = self.loop.time()
        self.writing = False
        self.sending: asyncio.Future[None] | None = None
        self.timer = self.loop.call_at(self.last + interval, self._look)

    def wrote(self) -> None:
        self.writing = False
        self.last = self.loop.time()

    def _look(self) -> None:
        now = self.loop.time()
        if self.writing or self.sending is not None:
            self.last = now  # a write is under way: not silent
        elif now - self.last >= self.interval:
            self.sending = asyncio.ensure_future(self._send())
            self.last = now
        self.timer = self.loop.call_at(self.last + self.interval, self._look)

    async def _send(self) -> None:
        try:
            await self.send({"type": "http.response.body", "body": self.chunk(), "more_body": True})
        except OSError:
            pass  # the client is gone: the writer's next write or the listener ends it
        finally:
            self.sending = None

    def close(self) -> None:
        self.timer.cancel()
        if self.sending is not None:
            self.sending.cancel()
