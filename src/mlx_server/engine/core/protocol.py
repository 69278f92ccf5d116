"""What the chat service and the server need of an engine. Every engine is an
``OwnedEngine`` (its own thread, started, cancelled and stopped by the server); the
generating ones (the continuous-batching ``Engine`` whatever its runner, the tests' scripted
engine) are ``EngineLike`` and ``ChatEngine``s too, the ``EmbeddingEngine`` is not;
monitoring (``/health``, ``/metrics``) needs only the counters, ``EngineCounters`` (a
registry's loaded engines are counted as one). An engine takes a ``GenerationObserver`` at construction:
the metrics watch its generations through it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar, runtime_checkable

from mlx_server.engine.core.handle import EngineEvent, GenerationHandle
from mlx_server.types import GenerationRequest

T = TypeVar("T")


@runtime_checkable
class EngineCounters(Protocol):
    """What monitoring reads of an engine; safe from any thread."""

    @property
    def active_count(self) -> int: ...

    @property
    def queue_depth(self) -> int: ...

    def stats(self) -> dict[str, Any]:
        """Monitoring counters: at least ``active`` and ``queued``."""
        ...


@runtime_checkable
class OwnedEngine(EngineCounters, Protocol):
    """An engine with its own thread (``owner.OwnerThread``): started, handed calls,
    cancelled and stopped by the server."""

    def start(self) -> None:
        """Start the engine's own thread (if it has one)."""

    def cancel(self, request_id: str | None = None) -> int:
        """Cancel one request by id, or all of them; returns how many."""
        ...

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` where the engine may make MLX arrays (its own thread, between two
        steps); the result or exception arrives through the future. From any thread."""
        ...

    def shutdown(self, timeout: float = 3.0) -> None:
        """Cancel everything and stop (bounded by ``timeout``)."""


@runtime_checkable
class EngineLike(OwnedEngine, Protocol):
    """An engine that generates: requests go in, a handle of events comes out."""

    def submit(
        self, req: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None
    ) -> GenerationHandle:
        """Queue a request; raises ``Overloaded`` when full or shutting down, and
        ``InvalidRequest`` for one that can never run."""
        ...


@runtime_checkable
class ChatEngine(EngineLike, Protocol):
    """An engine the chat service generates on."""

    def expect(self, request_id: str) -> Callable[[], None]:
        """Announce a request whose prompt is being built, so that requests arriving
        together start together; returns what to call once it was submitted or will not be."""
        ...


class GenerationObserver(Protocol):
    """What watches every generation of an engine it was given to (the metrics)."""

    def generation(self) -> Callable[[EngineEvent], None]:
        """Called as a generation is submitted; what it returns sees each of that
        generation's events as the engine pushes them (on the engine's thread)."""
        ...


def engine_stats(engine: EngineCounters) -> dict[str, Any]:
    """The engine's monitoring counters, with the basics every engine has."""
    return {"active": engine.active_count, "queued": engine.queue_depth, **engine.stats()}
