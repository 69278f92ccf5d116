"""Serving across ranks fails loudly, never hangs: each rank watches the others.

A collective whose peer is gone either raises (the ring backend's "connection to a peer was
lost") or waits for ever (an asynchronous evaluation that failed). So a thread on every
rank checks, four times a second:

- the ranks on this host, by process id (exchanged at start): one that is gone ends the
  server at once;
- the launcher (this process's parent): when it is gone (``mlx.launch`` killed), rank 0
  shuts down as on SIGTERM and the other ranks follow its last message;
- the section of work that waits on the other ranks (a step, a heartbeat, the wait for
  rank 0's next message): one that takes longer than the timeout means a rank stopped
  answering (a host that went away).

Ending is ``os._exit`` after a clear error line: the thread stuck in the collective cannot
be interrupted, and a clean shutdown would wait for it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from mlx_server.logs import log

POLL_S = 0.25


def host_id() -> int:
    """A number naming this host (the same in every process on it): its name and hardware
    address, so that two machines given the same name still differ."""
    return zlib.crc32(f"{socket.gethostname()}/{uuid.getnode()}".encode()) & 0x7FFFFFFF


def exchange_pids(group: Any) -> list[tuple[int, int]]:
    """(host id, process id) of every rank, by rank; a collective: every rank calls it once,
    after loading (it is the barrier the readiness line waits for)."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    mine = mx.array([[host_id(), os.getpid()]], dtype=mx.int64)
    with mx.stream(generation_stream):
        everyone = mx.distributed.all_gather(mine, group=group)
        mx.eval(everyone)
    rows = np.array(everyone).reshape(-1, 2)
    return [(int(h), int(p)) for h, p in rows]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RankWatch:
    """The watch of one rank; see the module docstring."""

    def __init__(self, rank: int, peers: list[tuple[int, int]], timeout_s: float):
        self.rank = rank
        self.timeout_s = timeout_s
        self.stopping = False  # a shutdown was asked for: a rank going away is expected
        here = host_id()
        self._local = {r: pid for r, (h, pid) in enumerate(peers) if h == here and r != rank}
        self._parent = os.getppid()
        self._section: tuple[str, float] | None = None
        self._reported: set[int] = set()  # ranks whose exit was reported (while stopping)
        self._ending = threading.Lock()  # one thread reports the end and exits
        self._thread = threading.Thread(target=self._run, name="rank-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @contextlib.contextmanager
    def section(self, what: str) -> Iterator[None]:
        """Work that waits on the other ranks; it must end within the timeout."""
        self._section = (what, time.monotonic())
        try:
            yield
        finally:
            self._section = None

    def failed(self, what: str, error: BaseException) -> None:
        """Work that waits on the other ranks raised (the ring's "connection to a peer was
        lost", ...): end this rank, naming the rank that is gone when one on this host is."""
        reason = f"{what} failed: {type(error).__name__}: {error}"
        gone = self._gone_peer(wait_s=1.0)
        self.lost(f"{gone} ({reason})" if gone else reason)

    def _gone_peer(self, wait_s: float) -> str | None:
        """A rank on this host that has exited, waiting up to ``wait_s`` for its parent to
        reap it (until then it still answers as a process)."""
        deadline = time.monotonic() + wait_s
        while True:
            for r, pid in self._local.items():
                if not _alive(pid):
                    return f"rank {r} (pid {pid}) exited"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def lost(self, reason: str) -> None:
        """End this rank: the ranks can no longer serve together. While shutting down that
        is expected: rank 0 finishes its own shutdown, the others exit."""
        if self.stopping:
            log(f"Ranks: {reason}")
            if self.rank == 0:
                return
            _exit(0)
        with self._ending:
            message = f"sharded serving stopped on rank {self.rank}: {reason}"
            log(f"Error: {message}")
            print(f"Error: {message}", file=sys.stderr, flush=True)
            _exit(1)

    def _run(self) -> None:
        parent_gone = False
        while True:
            time.sleep(POLL_S)
            for r, pid in self._local.items():
                if r not in self._reported and not _alive(pid):
                    self._reported.add(r)
                    self.lost(f"rank {r} (pid {pid}) exited")
            section = self._section
            if section is not None and time.monotonic() - section[1] > self.timeout_s:
                self._section = None
                self.lost(
                    f"the other ranks did not answer within {self.timeout_s:g}s (waiting for "
                    f"{section[0]})"
                )
            if not parent_gone and os.getppid() != self._parent:
                parent_gone = True
                self._launcher_gone()

    def _launcher_gone(self) -> None:
        self.stopping = True
        log("Ranks: the launcher is gone; shutting down")
        if self.rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # the server's own graceful shutdown


def _exit(code: int) -> None:
    sys.stdout.flush()
    os._exit(code)
