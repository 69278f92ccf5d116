"""The disk tier of the prefix cache: KV states kept in files across restarts.

Each entry is one safetensors file (MLX's own format, ``mx.save_safetensors``) holding the
state of every cache layer, of any kind (``serialize``), and the tokens it covers. A manifest
(``index.json``) lists the entries with their tokens, size, CRC-32 and last use, so start-up
reads one file, not every entry.

In parts: this module (looking entries up, handing new ones to the writer, the life of the
folder), ``disk_index`` (entries, the manifest, the shared state), ``disk_reader`` (files
back into states) and ``disk_writer`` (the writer thread).

Threads: the engine (MLX) thread looks entries up and hands new ones over: ``save`` cuts a
state's arrays and starts their evaluation behind the step in flight (waiting for it there
would cost the step loop its overlap with the GPU), and ``settle``, called once a step,
gives the writer the states saved three steps earlier or more (done by then: evaluating
them waits for nothing), all of them when the engine goes idle or the tier closes. Every MLX
evaluation stays on the engine's thread. A writer thread writes the files (to a temporary name, then
renamed: a crash never leaves a half-written entry under a real name), enforces the size
bound (least recently used first) and rewrites the manifest. A file whose size or CRC does
not match the manifest, or that fails to parse, is logged, deleted and treated as a miss.

An entry still waiting to be written is served from its arrays (the next turn of a
conversation often arrives before its multi-gigabyte state is on disk). Reading a file is
slow (gigabytes for a long prompt on a large model), so ``read_async`` reads and checks it on
a loader thread into host arrays; the engine thread only turns those into MLX arrays
(``materialize``), and running streams keep going while the file is read.

One open cache owns its folder: it holds an exclusive lock on it (``folder_lock``) from
start-up until ``close`` has stopped its writer. Start-up deletes the files its manifest does
not list, so a second cache on the same folder (another server for the same model, or a
second object in this process) must not touch it: it raises ``FolderLocked`` instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from mlx_server.config import user_cache_root
from mlx_server.engine.cache.disk_index import (
    MANIFEST,
    Entry,
    WriteJob,
    common_prefix,
    entry_name,
    read_manifest,
)
from mlx_server.engine.cache.disk_reader import DiskReads, FileRead
from mlx_server.engine.cache.disk_writer import DiskWrites
from mlx_server.engine.cache.folder_lock import FolderLock
from mlx_server.engine.cache.serialize import FORMAT_VERSION, serialize
from mlx_server.logs import log

# The memory the writes waiting for the writer may hold beyond ``max_pending`` of them (see
# ``DiskPromptCache``): a burst of 32 finishing streams of a 1B model, 500-token states. The
# engine's memory budget lowers it to a sixteenth of itself (``MemoryBudget``).
MAX_PENDING_BYTES = 1 << 30

__all__ = ["MANIFEST", "DiskPromptCache", "FileRead", "default_root", "model_cache_dir"]


def default_root() -> Path:
    """``$MLX_SERVER_PROMPT_CACHE_DIR``, else ``prompt-cache`` under the server's cache root
    (``config.user_cache_root``: ``~/Library/Caches/mlx-server`` on macOS)."""
    env = os.environ.get("MLX_SERVER_PROMPT_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return user_cache_root() / "prompt-cache"


def model_cache_dir(root: Path, model_dir: Path, layout: dict[str, Any]) -> Path:
    """The directory for one model and KV layout: named after the model, keyed by a hash of
    its config.json, its weight files' names, sizes and mtimes, and the KV layout (dtype,
    bits, layers, heads), so another model or dtype never reads these entries."""
    h = hashlib.sha256()
    h.update(f"format {FORMAT_VERSION}\n".encode())
    config = model_dir / "config.json"
    h.update(config.read_bytes() if config.is_file() else str(model_dir.resolve()).encode())
    for f in sorted(model_dir.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name} {st.st_size} {st.st_mtime_ns}\n".encode())
    h.update(json.dumps(layout, sort_keys=True).encode())
    return root / f"{model_dir.resolve().name}-{h.hexdigest()[:16]}"


class DiskPromptCache(DiskReads, DiskWrites):
    """KV states on disk, bounded by ``max_bytes``; see the module docstring.

    ``min_tokens``: shorter states are not worth a file. Writes waiting for the writer thread
    hold their arrays in memory (counted in the engine's memory budget): a new one is taken
    while fewer than ``max_pending`` wait, or while all of them with it hold at most
    ``max_pending_bytes``; beyond, it is dropped (counted). The bytes let a burst of small
    states through (streams finishing together each evict one: with 4 slots, 4 of 32 were
    written on the GPU kit's 1B), the count a few large ones.
    Raises ``FolderLocked`` (an ``OSError``), having touched nothing, when another cache
    holds ``directory``; one that is closing is waited for, at most ``lock_wait_s`` seconds.
    """

    def __init__(
        self,
        directory: Path,
        max_bytes: int,
        *,
        min_tokens: int = 256,
        max_pending: int = 4,
        max_pending_bytes: int = MAX_PENDING_BYTES,
        lock_wait_s: float = 0.0,
    ):
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self.hits = self.misses = self.corrupt = self.dropped = 0
        self.read_bytes = self.written_bytes = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self.pending_bytes = 0  # arrays held by queued writes
        self._dirty = False
        self._queue = queue.Queue()
        self._queued = {}  # written soon, served from RAM
        # saved, their arrays still being computed behind a step: (settle count, job)
        self._settling: list[tuple[int, WriteJob]] = []
        self._settled = 0  # calls of ``settle``
        self._closing = False  # saves go to the writer at once
        self._saver: int | None = None  # the thread that saves (the engine's)
        self._loader = None  # the thread pool that reads files (made on first use)
        self.oversize = 0  # states larger than the whole tier, never written
        self._closed = False  # no more saves
        self._stopping = False  # the writer ends once nothing is pending
        self._released = False  # the folder is given up: no more deletes
        self.directory.mkdir(parents=True, exist_ok=True)
        self._folder = FolderLock.acquire(self.directory, lock_wait_s)
        try:
            self._entries, self._dirty = read_manifest(self.directory)
        except BaseException:
            self._folder.release()
            raise
        self._writer = threading.Thread(
            target=self._write_loop, name="prompt-cache-disk", daemon=True
        )
        self._writer.start()

    # ---- engine thread -----------------------------------------------------------------

    def lookup(self, tokens: list[int], floor: int = 0) -> tuple[str, int] | None:
        """The entry covering the longest prefix of ``tokens`` beyond ``floor`` tokens (at
        most all but the last token) and how many of its tokens to keep; None if none."""
        if not tokens:
            return None
        p = np.asarray(tokens, dtype=np.int32)
        best: tuple[str, int] | None = None
        for e in self._candidates():
            common = common_prefix(e.tokens, p)
            if common == len(e.tokens) and len(e.tokens) < len(p):
                keep = common  # the whole entry, then the rest of the prompt
            elif e.trimmable:
                keep = min(common, len(p) - 1)
            else:
                continue
            if keep > floor and keep >= self.min_tokens and (best is None or keep > best[1]):
                best = (e.name, keep)
        return best

    def _candidates(self) -> list[Entry]:
        """Entries on disk and those waiting to be written."""
        with self._lock:
            return list(self._entries.values()) + [e for e, _ in self._queued.values()]

    def is_queued(self, name: str) -> bool:
        """Whether ``name`` is waiting to be written (``load`` serves it from RAM, at once)."""
        with self._lock:
            return name in self._queued

    def covers(self, tokens: list[int]) -> bool:
        """Whether an entry already serves every token of ``tokens``."""
        p = np.asarray(tokens, dtype=np.int32)
        for e in self._candidates():
            if len(e.tokens) >= len(p) and (e.trimmable or len(e.tokens) == len(p)):
                if common_prefix(e.tokens, p) == len(p):
                    return True
        return False

    def save(self, tokens: list[int], cache: list[Any], kind: str) -> bool:
        """Hand a KV state to the writer. Its arrays are cut to ``len(tokens)`` and evaluated
        here (on the MLX thread); the file is written in the background. Returns whether it
        was queued (not: too short, already covered, too large, or queue full). Raises for
        a state that cannot be written (``kv_serialize.Unsupported``): the caller drops it."""
        if self._closed or len(tokens) < self.min_tokens or self.covers(tokens):
            return False
        packed = serialize(cache, len(tokens))
        if packed is None:
            return False
        arrays, metadata, trimmable = packed
        size = sum(a.nbytes for a in arrays.values())
        if size > self.max_bytes:
            self.oversize += 1
            log(
                f"Prompt cache: a {len(tokens)}-token state ({size >> 20}MB) is larger than the "
                f"disk tier ({self.max_bytes >> 20}MB, --prompt-cache-disk-gb): not written"
            )
            return False
        with self._lock:
            if self._closed:
                return False
            if not self._room_locked(size):
                self.dropped += 1
                return False
        import mlx.core as mx

        arrays["tokens"] = mx.array(tokens, dtype=mx.int32)
        # Behind the step in flight; before a slot is taken: a failure here leaks none.
        mx.async_eval(list(arrays.values()))
        held = size + arrays["tokens"].nbytes
        with self._lock:  # the slot and its bytes taken together: no other save sees half
            if self._closed or not self._room_locked(held):
                self.dropped += 1
                return False
            self._pending += 1
            self.pending_bytes += held
        job = WriteJob(np.asarray(tokens, dtype=np.int32), arrays, metadata, kind, trimmable)
        name = entry_name(job.tokens)
        entry = Entry(name, job.tokens, size, 0, kind, trimmable, time.time())
        with self._lock:
            self._queued[name] = (entry, job)
        self._saver = threading.get_ident()
        self._settling.append((self._settled, job))
        if self._closing:
            self.settle(everything=True)
        return True

    def _room_locked(self, size: int) -> bool:
        """Whether a write of ``size`` bytes may wait for the writer beside those waiting."""
        if self._pending < self.max_pending:
            return True
        return self.pending_bytes + size <= self.max_pending_bytes

    def stats(self) -> dict[str, int]:
        with self._lock:
            n, size = len(self._entries), sum(e.nbytes for e in self._entries.values())
        return {
            "prompt_cache_disk_entries": n,
            "prompt_cache_disk_bytes": size,
            "prompt_cache_disk_hits": self.hits,
            "prompt_cache_disk_misses": self.misses,
            "prompt_cache_disk_read_bytes": self.read_bytes,
            "prompt_cache_disk_written_bytes": self.written_bytes,
            "prompt_cache_disk_corrupt": self.corrupt,
            "prompt_cache_disk_oversize": self.oversize,
            # states not written because the waiting writes held their limit already
            "prompt_cache_disk_dropped": self.dropped,
        }

    def mark_closing(self) -> None:
        """Tell a server waiting for this folder that ``close`` is coming (the last writes
        are under way); from here a state saved goes to the writer at once."""
        self._closing = True
        self.settle(everything=True)
        self._folder.mark_closing()

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new saves, let the writer finish the queued ones and the manifest, then
        give the folder up. Waits at most ``timeout`` seconds and returns whether the folder
        was given up by then; otherwise the writer gives it up when its last write ends (or
        the process exits), so the next owner never deletes a file still being written."""
        self.settle(everything=True)
        with self._lock:
            self._closed = self._stopping = True
        self._folder.mark_closing()
        self._queue.put(None)  # wake the writer
        if self._loader is not None:  # reads nobody will take
            self._loader.shutdown(wait=False, cancel_futures=True)
        self._writer.join(timeout)
        return not self._writer.is_alive()

    @property
    def released(self) -> bool:
        """Whether the folder has been given up (after ``close``)."""
        return not self._folder.held
