"""A scripted engine: replays chosen text piece by piece through the real server stack.

It has the engine's public interface (``EngineLike``: submit, cancel, call, stats, ...)
and applies stop strings and max_tokens like the real one, so protocol tests are exact.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mlx_server.engine.core.handle import GenerationHandle, Started, TokenPiece
from mlx_server.errors import ModelUnavailable, Overloaded
from mlx_server.events import Finished, Timings, Usage
from mlx_server.parsing.stops import StopMatcher
from mlx_server.types import GenerationRequest

T = TypeVar("T")


@dataclass
class Script:
    pieces: list[str]
    delay: float = 0.0  # seconds between pieces
    finish: str = "stop"  # how the text ends when it runs out: "stop" (EOS) or "error"
    # Held before the first piece until set (a long prefill that ends when the test says).
    gate: threading.Event | None = None
    # Held before the engine takes the request up (a request waiting in the queue).
    start_gate: threading.Event | None = None


@dataclass
class ScriptedEngine:
    default: Script = field(default_factory=lambda: Script(["Hello", " there", "!"]))
    scripts: deque[Script] = field(default_factory=deque)
    requests: list[GenerationRequest] = field(default_factory=list)
    max_queue: int = 64
    observer: Any = None  # a GenerationObserver (the metrics), as a real engine takes one
    _active: dict[tuple[str, int], GenerationHandle] = field(default_factory=dict)
    _tasks: set[asyncio.Task] = field(default_factory=set)
    stopping: bool = False
    start_error: str = ""  # as the engine's: its first token failed after the readiness line

    def push(
        self,
        *pieces: str,
        delay: float = 0.0,
        finish: str = "stop",
        gate: threading.Event | None = None,
        start_gate: threading.Event | None = None,
    ) -> None:
        self.scripts.append(Script(list(pieces), delay, finish, gate, start_gate))

    def start(self) -> None:
        pass

    def expect(self, request_id: str) -> Callable[[], None]:
        return lambda: None  # no batch to gather: every request plays at once

    def submit(
        self, req: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None
    ) -> GenerationHandle:
        if self.start_error:
            raise ModelUnavailable(f"the model cannot serve: {self.start_error}")
        if self.stopping:
            raise Overloaded("the server is shutting down")
        if len(self._active) >= self.max_queue:
            raise Overloaded("the request queue is full")
        loop = loop or asyncio.get_running_loop()
        script = self.scripts.popleft() if self.scripts else self.default
        observe = self.observer.generation() if self.observer is not None else None
        handle = GenerationHandle(req.request_id, loop, observe=observe)
        self.requests.append(req)
        self._active[(req.request_id, id(handle))] = handle
        task = loop.create_task(self._play(req, handle, script))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return handle

    async def _play(self, req: GenerationRequest, handle: GenerationHandle, script: Script) -> None:
        stops = StopMatcher(req.stop)
        n = 0
        reason = script.finish
        try:
            if script.start_gate is not None:
                if not await asyncio.to_thread(script.start_gate.wait, 30):
                    raise TimeoutError("the script's start gate was never opened")
            handle.push(Started(0))
            if script.gate is not None and not await asyncio.to_thread(script.gate.wait, 30):
                raise TimeoutError("the script's gate was never opened")
            for piece in script.pieces:
                if handle.cancelled:
                    reason = "cancelled"
                    break
                if n >= req.max_tokens:
                    reason = "length"
                    break
                n += 1
                out = stops.feed(piece)
                if out:
                    handle.push(TokenPiece(out))
                if stops.matched is not None:
                    reason = "stop_sequence"
                    break
                await asyncio.sleep(script.delay)
            else:
                if handle.cancelled:
                    reason = "cancelled"
            if reason not in ("stop_sequence", "cancelled"):
                tail = stops.flush()
                if tail:
                    handle.push(TokenPiece(tail))
        finally:
            self._active.pop((req.request_id, id(handle)), None)
            usage = Usage(len(req.prompt_tokens), n)
            timings = Timings(len(req.prompt_tokens), 1.0, n, 1.0 + n)
            err = "scripted failure" if reason == "error" else None
            handle.push(Finished(reason, usage, timings, stop_sequence=stops.matched, error=err))

    def cancel(self, request_id: str | None = None) -> int:
        n = 0
        for (rid, _), h in list(self._active.items()):
            if not h.cancelled and (request_id is None or rid == request_id):
                h.cancel()
                n += 1
        return n

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """No engine thread here: ``fn`` runs at once."""
        future: Future[T] = Future()
        try:
            future.set_result(fn())
        except Exception as e:
            future.set_exception(e)
        return future

    def stats(self) -> dict[str, Any]:
        return {"active": self.active_count, "queued": self.queue_depth}

    @property
    def active_count(self) -> int:
        return len(self._active)

    @property
    def queue_depth(self) -> int:
        return 0

    def shutdown(self, timeout: float = 0) -> None:
        self.stopping = True
        self.cancel()
