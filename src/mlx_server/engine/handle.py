"""The bridge between the engine thread and asyncio consumers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from mlx_server.events import Finished, LogprobEntry


@dataclass(frozen=True)
class TokenPiece:
    """Decoded text for one or more generated tokens (stop strings already removed)."""

    text: str
    logprobs: tuple[LogprobEntry, ...] = ()


@dataclass(frozen=True)
class Started:
    """The engine took the request up: its first event. ``cached_tokens`` of the prompt's
    tokens came from the prefix cache and will not be computed again."""

    cached_tokens: int = 0


EngineEvent = Started | TokenPiece | Finished


class GenerationHandle:
    """One request's stream of engine events, consumed with ``async for``.

    The engine thread pushes events with ``loop.call_soon_threadsafe``; ``cancel()`` may be
    called from anywhere and takes effect at the engine's next step.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self.cancelled = False
        self.done = False
        self.cached_tokens = 0

    def cancel(self) -> None:
        self.cancelled = True

    def push(self, event: EngineEvent) -> None:
        """Called from the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more

    async def next_event(self) -> EngineEvent:
        """The next event (for a consumer that reads the first one on its own)."""
        event = await self._queue.get()
        if isinstance(event, Finished):
            self.done = True
        return event

    async def __aiter__(self) -> AsyncIterator[EngineEvent]:
        if self.done:
            return
        while True:
            event = await self._queue.get()
            yield event
            if isinstance(event, Finished):
                self.done = True
                return
