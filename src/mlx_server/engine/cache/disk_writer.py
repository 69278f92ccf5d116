"""The disk tier's writer thread: queued states written to files (a temporary name, then
renamed: a crash never leaves a half-written entry under a real name), the size bound
enforced (least recently used first), the manifest rewritten; and the folder given up once
the last write after ``close`` is done. See ``disk.py``."""

from __future__ import annotations

import os
import threading
import time

from mlx_server.engine.cache.disk_index import (
    SUFFIX,
    TMP_PREFIX,
    DiskState,
    Entry,
    WriteJob,
    common_prefix,
    entry_name,
    file_crc,
    write_manifest,
)
from mlx_server.logs import log


class DiskWrites(DiskState):
    """The writing half of ``DiskPromptCache``."""

    def settle(self, everything: bool = False) -> None:
        """Give the writer the states ``save`` left computing: those saved three calls ago
        or earlier, or all of them. Called on the thread that saves (the engine's) before
        each step and with ``everything`` when it goes idle: a state saved while step k+1
        was in flight is handed over before step k+3, when the engine has waited for step
        k+2, queued after the state's arrays (so evaluating them here waits for nothing).
        A failure to evaluate them drops them (counted as dropped) and is raised."""
        self._settled += 1
        ready = len(self._settling)
        if not everything:
            ready = sum(1 for n, _ in self._settling if n <= self._settled - 3)
        if not ready:
            return
        jobs = [job for _, job in self._settling[:ready]]
        del self._settling[:ready]
        import mlx.core as mx

        try:
            mx.eval([a for job in jobs for a in job.arrays.values()])
        except Exception:
            with self._idle:
                for job in jobs:
                    self._release_locked(job)
                    self.dropped += 1
                self._idle.notify_all()
            raise
        for job in jobs:
            self._queue.put(job)

    def _release_locked(self, job: WriteJob) -> None:
        """A pending write is over (written, failed or dropped): its slot and memory go."""
        self._pending -= 1
        self._queued.pop(entry_name(job.tokens), None)
        self.pending_bytes -= sum(a.nbytes for a in job.arrays.values())

    @property
    def busy(self) -> bool:
        """Whether the writer's slots are taken (``save`` takes a new state only if it fits
        ``max_pending_bytes`` beside the waiting ones)."""
        return self._pending >= self.max_pending

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is on disk and the manifest is current. On the
        thread that saves, states still settling are handed over first; on another (a test
        beside a running engine) the engine hands them over when it goes idle."""
        if self._saver in (None, threading.get_ident()):
            self.settle(everything=True)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._pending or self._dirty:
                if self._released:  # closed: the writer is gone
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                if not self._pending and self._dirty:
                    self._queue.put(None)  # ask the writer for a manifest
                self._idle.wait(left if left is None else min(left, 0.5))
        return True

    def _write_loop(self) -> None:
        try:
            while self._write_next():
                pass
        finally:
            with self._idle:
                self._released = True
                self._folder.release()
                self._idle.notify_all()

    def _write_next(self) -> bool:
        """Write the next queued entry (or, with None, the manifest); False once closed and
        nothing is left to write."""
        job = self._queue.get()
        if job is not None:
            try:
                self._write(job)
            except Exception as e:  # a full or read-only disk: skip the entry, go on
                log(f"Prompt cache: could not write an entry: {type(e).__name__}: {e}")
        with self._idle:
            if job is not None:
                self._release_locked(job)
                job = None  # the arrays go now, not at the next job
            done = self._stopping and not self._pending
            if self._dirty and (done or self._queue.empty()):
                self._write_manifest_locked()
            self._idle.notify_all()
        return not done

    def _write(self, job: WriteJob) -> None:
        import mlx.core as mx

        name = entry_name(job.tokens)
        tmp = self.directory / f"{TMP_PREFIX}{name}-{os.getpid()}-{threading.get_ident()}"
        mx.save_safetensors(str(tmp), job.arrays, job.metadata)
        tmp = tmp.with_name(tmp.name + SUFFIX)
        size, crc = tmp.stat().st_size, file_crc(tmp)
        entry = Entry(name, job.tokens, size, crc, job.kind, job.trimmable, time.time())
        with self._lock:
            os.replace(tmp, self.path_of(name))
            self._entries[name] = entry
            self.written_bytes += size
            self._dirty = True
            self._drop_covered_locked(entry)
            self._enforce_bound_locked()

    def _drop_covered_locked(self, new: Entry) -> None:
        """A trimmable entry serves all its prefixes: shorter conversation entries go
        (system-prompt entries stay, as in the RAM tier)."""
        if not new.trimmable:
            return
        for e in list(self._entries.values()):
            if (
                e is not new
                and e.kind != "system"
                and len(e.tokens) < len(new.tokens)
                and common_prefix(e.tokens, new.tokens) == len(e.tokens)
            ):
                self._delete_locked(e.name)

    def _enforce_bound_locked(self) -> None:
        total = sum(e.nbytes for e in self._entries.values())
        for e in sorted(self._entries.values(), key=lambda e: e.used):
            if total <= self.max_bytes:
                break
            total -= e.nbytes
            self._delete_locked(e.name)

    def _write_manifest_locked(self) -> None:
        if write_manifest(self.directory, self._entries):
            self._dirty = False
