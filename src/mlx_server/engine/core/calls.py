"""Calls other threads ask the engine thread to run between two steps (``Engine.call``)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from mlx_server.errors import Overloaded

T = TypeVar("T")


class Calls:
    """A queue of calls guarded by the scheduler's ``wake`` condition (adding one wakes the
    engine thread); ``stopping`` tells whether new ones are refused."""

    def __init__(self, wake: threading.Condition, stopping: Callable[[], bool]):
        self._wake = wake
        self._stopping = stopping
        self._queue: deque[tuple[Callable[[], Any], Future[Any]]] = deque()

    def __bool__(self) -> bool:
        return bool(self._queue)

    def add(self, fn: Callable[[], T]) -> Future[T]:
        """From any thread; raises Overloaded once the engine is stopping."""
        future: Future[T] = Future()
        with self._wake:
            if self._stopping():
                raise Overloaded("the server is shutting down")
            self._queue.append((fn, future))
            self._wake.notify()
        return future

    def run(self) -> None:
        """Run the calls asked for (on the engine thread)."""
        while self._queue:
            fn, future = self._queue.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # the caller gets it, the engine goes on
                    future.set_exception(e)

    def fail(self) -> None:
        """Refuse the calls left (the engine stops)."""
        with self._wake:
            calls, self._queue = list(self._queue), deque()
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(Overloaded("the server is shutting down"))
