"""The one thread that owns MLX for an engine (MLX streams are bound to a thread), shared by
the text engine and the embedding engine.

``OwnerThread`` runs the loop both engines are made of: prepare (warm up), say ready, then
while there is work run the calls other threads handed in (``call``) and one step of the
engine's own work; once stopping, refuse the calls left and end what is left. An engine
says what work is (``_wait_for_work``, ``_work``), how it stops (``_stop``) and what ending
means for its requests (``_stopped``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from mlx_server.engine.core import mlx_threads
from mlx_server.engine.core.calls import Calls

T = TypeVar("T")


class OwnerThread:
    """An engine's owner thread; ``wake`` is the condition its work is guarded by (adding a
    call notifies it), ``stopping`` tells whether the engine is stopping."""

    def __init__(self, name: str, wake: threading.Condition, stopping: Callable[[], bool]):
        self._thread_name = name
        self._calls = Calls(wake, stopping)
        self._ready = threading.Event()
        self._ended = threading.Event()  # the loop returned (the thread itself lives on)
        self._thread: threading.Thread | None = None

    # ---- any thread --------------------------------------------------------------------

    def start(self) -> None:
        """Run the loop on one of the process's MLX threads (``mlx_threads``: a thread that
        ran MLX on a GPU must not end while another engine serves)."""
        self._thread = mlx_threads.run(self._thread_name, self._run_to_end)

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the engine thread (the one thread that may make MLX arrays) between
        two steps; its result or exception arrives through the future. From any thread;
        raises Overloaded once the engine is stopping."""
        return self._calls.add(fn)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the engine thread has warmed up and serves (True), or ``timeout``."""
        return self._ready.wait(timeout)

    def shutdown(self, timeout: float = 3.0) -> None:
        """Stop (``_stop``: what is queued and running ends) and wait for the loop to end
        (bounded by ``timeout``)."""
        self._stop()
        if self._thread is not None:
            self._ended.wait(timeout)

    @property
    def ended(self) -> bool:
        """Whether the loop has returned (the thread went back to ``mlx_threads``)."""
        return self._ended.is_set()

    # ---- the owner thread --------------------------------------------------------------

    def _run_to_end(self) -> None:
        try:
            self._run()
        finally:
            self._ended.set()

    def _run(self) -> None:
        self._prepare()
        self._ready.set()
        while self._wait_for_work():
            self._calls.run()
            self._work()
        self._calls.fail()
        self._stopped()

    def _prepare(self) -> None:
        """Before serving (a warm-up); nothing by default."""

    def _wait_for_work(self) -> bool:
        """Sleep until there is something to do; False once the loop should end."""
        raise NotImplementedError

    def _work(self) -> None:
        """One step of the engine's own work (the calls were run just before)."""
        raise NotImplementedError

    def _stop(self) -> None:
        """Tell the loop to end (any thread; wakes it)."""
        raise NotImplementedError

    def _stopped(self) -> None:
        """The loop ended: end what is left (on the owner thread)."""
