"""The bridge between the engine thread and asyncio consumers."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
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


class Outbox:
    """Events the engine thread produced during one step, handed to asyncio together.

    Waking an event loop from another thread costs a system call, and the woken loop then
    competes with the engine thread for the interpreter lock: one wake-up per loop per
    step, not one per token per sequence. Used only from the engine thread.
    """

    def __init__(self) -> None:
        self._events: list[tuple[GenerationHandle, EngineEvent]] = []

    def put(self, handle: GenerationHandle, event: EngineEvent) -> None:
        self._events.append((handle, event))

    def flush(self) -> None:
        if not self._events:
            return
        events, self._events = self._events, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[GenerationHandle, EngineEvent]]] = {}
        for handle, event in events:
            by_loop.setdefault(handle._loop, []).append((handle, event))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:
                pass  # the event loop is closed: nobody is listening any more


def _deliver(batch: list[tuple[GenerationHandle, EngineEvent]]) -> None:
    for handle, event in batch:
        handle._put(event)


class GenerationHandle:
    """One request's stream of engine events, consumed with ``async for``.

    The engine thread pushes events with ``loop.call_soon_threadsafe`` (through ``outbox``,
    once per step, when one is given); ``cancel()`` may be called from anywhere and takes
    effect at the engine's next step. With ``coalesce``, a consumer that falls behind gets
    the text pieces waiting for it merged into one (fewer, larger stream chunks under load,
    the same text and logprobs).
    """

    def __init__(
        self,
        request_id: str,
        loop: asyncio.AbstractEventLoop,
        outbox: Outbox | None = None,
        coalesce: bool = False,
        observe: Callable[[EngineEvent], None] | None = None,
    ):
        """``observe``: sees every event as the engine pushes it (an engine's observer)."""
        self.request_id = request_id
        self._observe = observe
        self._loop = loop
        self._outbox = outbox
        self._coalesce = coalesce
        # Events delivered and not yet taken, and the consumer's future while it waits for
        # one: a deque and one future, not an ``asyncio.Queue`` (whose put and get cost
        # several calls each, per token of every stream).
        self._events: deque[EngineEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None
        # The event that stopped a merge, read from the queue and not yet yielded. The
        # handle's, not one iteration's: a consumer may leave its ``async for`` after the
        # merged piece and iterate again (or call ``next_event``), and must still get it.
        self._held: EngineEvent | None = None
        self.cancelled = False
        self.done = False

    def cancel(self) -> None:
        self.cancelled = True

    def push(self, event: EngineEvent) -> None:
        """Called from the engine thread."""
        if self._observe is not None:
            self._observe(event)
        if self._outbox is not None:
            self._outbox.put(self, event)
            return
        try:
            self._loop.call_soon_threadsafe(self._put, event)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more

    def _put(self, event: EngineEvent) -> None:
        """On the event loop: queue ``event`` and wake the consumer if it waits."""
        self._events.append(event)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def next_event(self) -> EngineEvent:
        """The next event (for a consumer that reads the first one on its own)."""
        event = await self._take()
        if isinstance(event, Finished):
            self.done = True
        return event

    async def __aiter__(self) -> AsyncIterator[EngineEvent]:
        while not self.done:
            event = await self._take()
            if self._coalesce and isinstance(event, TokenPiece):
                event, self._held = self._merge_waiting(event)
            if isinstance(event, Finished):
                self.done = True
            yield event

    async def _take(self) -> EngineEvent:
        """The held event if there is one, else the next queued one."""
        if self._held is not None:
            event, self._held = self._held, None
            return event
        events = self._events
        while not events:
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                if self._waiter is waiter:
                    self._waiter = None
        return events.popleft()

    def _merge_waiting(self, first: TokenPiece) -> tuple[TokenPiece, EngineEvent | None]:
        """``first`` and the text pieces queued behind it as one piece; also the event
        that stopped the merge (a Finished), to be yielded next."""
        events = self._events
        if not events:
            return first, None
        texts, logprobs = [first.text], list(first.logprobs)
        while events:
            event = events.popleft()
            if not isinstance(event, TokenPiece):
                return TokenPiece("".join(texts), tuple(logprobs)), event
            texts.append(event.text)
            logprobs.extend(event.logprobs)
        return TokenPiece("".join(texts), tuple(logprobs)), None
