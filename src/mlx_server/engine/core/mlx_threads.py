"""Threads that run MLX on a GPU live as long as the process: an engine that stops gives its
thread back here, and the next engine to start takes it.

MLX's CUDA backend keeps per-thread state (cuBLASLt and cuDNN handles, command encoders,
cuDNN graph caches: ``thread_local`` in ``mlx/backend/cuda``). When a thread that used the GPU
ends, those destructors run on it, and destroying a cuDNN handle synchronizes the whole device
(``cuCtxSynchronize``). A device-wide synchronize while another thread captures a CUDA graph
(MLX captures every cuBLASLt and cuDNN call) invalidates that capture, and MLX ends the process:
``cudaStreamEndCapture ... failed: operation failed due to a previous error during capture``,
``terminate called``. Measured on an H100 (``bench/gpu/speculative.sh`` with
``CUDA_LOG_FILE``): an engine's thread ending while the next engine warmed up, every run,
the first synchronize from a native thread and not the capturing one. A server that unloads
one model while another serves, or a benchmark that starts engines one after another, did
exactly that. Keeping the threads (parked, waiting for the next engine) means those
destructors never run while the process serves; a parked thread's caches are the next
engine's (its cuDNN graphs are built already).
"""

from __future__ import annotations

import queue
import sys
import threading
import traceback
from collections.abc import Callable

_lock = threading.Lock()
_parked: list[_Worker] = []
_made = 0  # threads made in this process (tests read it)


class _Worker:
    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def give(self, name: str, job: Callable[[], None]) -> None:
        self.thread.name = name
        self._jobs.put(job)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            except BaseException:  # what a dying thread would have printed; it lives on
                traceback.print_exc(file=sys.stderr)
            finally:
                del job
                self.thread.name = "mlx-parked"
                with _lock:
                    _parked.append(self)


def run(name: str, job: Callable[[], None]) -> threading.Thread:
    """Run ``job`` on a parked MLX thread (a new one when none is parked), named ``name``
    while it runs. Returns the thread; it does not end when ``job`` returns, so wait for the
    job itself (an event it sets), not with ``join``."""
    global _made
    with _lock:
        worker = _parked.pop() if _parked else None
        if worker is None:
            _made += 1
    if worker is None:
        worker = _Worker(name)
    worker.give(name, job)
    return worker.thread


def made() -> int:
    """How many MLX threads this process has made."""
    with _lock:
        return _made


def parked() -> list[threading.Thread]:
    """The threads that wait for an engine now."""
    with _lock:
        return [w.thread for w in _parked]
