"""The disk tier of the prefix cache: KV states kept in files across restarts.

Each entry is one safetensors file (MLX's own format, ``mx.save_safetensors``) holding the
state of every cache layer, of any kind (``kv_serialize``), and the tokens it covers. A manifest
(``index.json``) lists the entries with their tokens, size, CRC-32 and last use, so start-up
reads one file, not every entry.

Threads: the engine (MLX) thread looks entries up and hands new ones over with ``save``
after evaluating their arrays; a writer thread writes the files (to a temporary name, then
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

import base64
import hashlib
import json
import os
import queue
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlx_server.config import user_cache_root
from mlx_server.engine.cache.folder_lock import FolderLock
from mlx_server.engine.cache.serialize import FORMAT_VERSION, deserialize, serialize
from mlx_server.logs import log

MANIFEST = "index.json"
_SUFFIX = ".safetensors"
_TMP_PREFIX = ".tmp-"
_CHUNK = 8 << 20


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


@dataclass
class _Entry:
    name: str
    tokens: np.ndarray  # int32
    nbytes: int
    crc: int
    kind: str
    trimmable: bool
    used: float

    def to_json(self) -> dict[str, Any]:
        return {
            "tokens": base64.b64encode(self.tokens.astype("<i4").tobytes()).decode(),
            "bytes": self.nbytes,
            "crc": self.crc,
            "kind": self.kind,
            "trimmable": self.trimmable,
            "used": self.used,
        }

    @classmethod
    def from_json(cls, name: str, d: dict[str, Any]) -> _Entry:
        tokens = np.frombuffer(base64.b64decode(d["tokens"]), dtype="<i4").astype(np.int32)
        return cls(
            name, tokens, int(d["bytes"]), int(d["crc"]), str(d["kind"]), bool(d["trimmable"]),
            float(d["used"]),
        )  # fmt: skip


@dataclass
class _Job:
    tokens: np.ndarray
    arrays: dict[str, Any]
    metadata: dict[str, str]
    kind: str
    trimmable: bool


@dataclass
class FileRead:
    """An entry's file read and checked off the engine thread: host arrays, not MLX ones."""

    name: str
    arrays: dict[str, tuple[np.ndarray, str]]  # key -> (data, safetensors dtype)
    metadata: dict[str, str]
    tokens: list[int]
    kind: str
    nbytes: int


# safetensors dtypes as numpy can hold them; bfloat16 travels as its 16 bits.
_NP_DTYPES = {
    "BF16": "<u2", "F16": "<f2", "F32": "<f4", "F64": "<f8", "U8": "u1", "I8": "i1",
    "U16": "<u2", "I16": "<i2", "U32": "<u4", "I32": "<i4", "U64": "<u8", "I64": "<i8",
}  # fmt: skip


def _parse_safetensors(buf: bytes) -> tuple[dict[str, tuple[np.ndarray, str]], dict[str, str]]:
    """The arrays (views of ``buf``) and metadata of a safetensors file's bytes."""
    n = int.from_bytes(buf[:8], "little")
    header = json.loads(buf[8 : 8 + n])
    metadata = header.pop("__metadata__", {}) or {}
    base = 8 + n
    arrays = {}
    for key, t in header.items():
        start, end = t["data_offsets"]
        data = np.frombuffer(buf, dtype=_NP_DTYPES[t["dtype"]], count=-1, offset=base + start)
        arrays[key] = (data[: (end - start) // data.itemsize].reshape(t["shape"]), t["dtype"])
    return arrays, metadata


def _file_crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _entry_name(tokens: np.ndarray) -> str:
    return hashlib.sha256(tokens.tobytes()).hexdigest()[:32]


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class DiskPromptCache:
    """KV states on disk, bounded by ``max_bytes``; see the module docstring.

    ``min_tokens``: shorter states are not worth a file. ``max_pending``: writes waiting for
    the writer thread (each holds its arrays in memory); beyond it new ones are dropped.
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
        lock_wait_s: float = 0.0,
    ):
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self.max_pending = max_pending
        self.hits = self.misses = self.corrupt = self.dropped = 0
        self.read_bytes = self.written_bytes = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self.pending_bytes = 0  # arrays held by queued writes
        self._dirty = False
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._queued: dict[str, tuple[_Entry, _Job]] = {}  # written soon, served from RAM
        self._loader: Any = None  # the thread pool that reads files (made on first use)
        self.oversize = 0  # states larger than the whole tier, never written
        self._closed = False  # no more saves
        self._stopping = False  # the writer ends once nothing is pending
        self._released = False  # the folder is given up: no more deletes
        self.directory.mkdir(parents=True, exist_ok=True)
        self._folder = FolderLock.acquire(self.directory, lock_wait_s)
        try:
            self._entries: dict[str, _Entry] = self._read_index()
        except BaseException:
            self._folder.release()
            raise
        self._writer = threading.Thread(
            target=self._write_loop, name="prompt-cache-disk", daemon=True
        )
        self._writer.start()

    # ---- start-up ----------------------------------------------------------------------

    def _read_index(self) -> dict[str, _Entry]:
        """The manifest's entries whose file exists with the listed size; temporary and
        unlisted files (left by a crash) are deleted."""
        entries: dict[str, _Entry] = {}
        try:
            doc = json.loads((self.directory / MANIFEST).read_text())
            if doc.get("version") == FORMAT_VERSION:
                for name, d in doc.get("entries", {}).items():
                    entries[name] = _Entry.from_json(name, d)
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as e:
            log(f"Prompt cache: ignoring an unreadable manifest in {self.directory} ({e})")
        on_disk = {}
        for f in self.directory.iterdir():
            if f.name.startswith(_TMP_PREFIX) or (f.suffix == _SUFFIX and f.stem not in entries):
                f.unlink(missing_ok=True)
            elif f.suffix == _SUFFIX:
                on_disk[f.stem] = f.stat().st_size
        kept = {n: e for n, e in entries.items() if on_disk.get(n) == e.nbytes}
        for name in on_disk.keys() - kept.keys():
            (self.directory / f"{name}{_SUFFIX}").unlink(missing_ok=True)
        if len(kept) != len(entries):
            self._dirty = True
        return kept

    # ---- engine thread -----------------------------------------------------------------

    def lookup(self, tokens: list[int], floor: int = 0) -> tuple[str, int] | None:
        """The entry covering the longest prefix of ``tokens`` beyond ``floor`` tokens (at
        most all but the last token) and how many of its tokens to keep; None if none."""
        if not tokens:
            return None
        p = np.asarray(tokens, dtype=np.int32)
        best: tuple[str, int] | None = None
        for e in self._candidates():
            common = _common_prefix(e.tokens, p)
            if common == len(e.tokens) and len(e.tokens) < len(p):
                keep = common  # the whole entry, then the rest of the prompt
            elif e.trimmable:
                keep = min(common, len(p) - 1)
            else:
                continue
            if keep > floor and keep >= self.min_tokens and (best is None or keep > best[1]):
                best = (e.name, keep)
        return best

    def _candidates(self) -> list[_Entry]:
        """Entries on disk and those waiting to be written."""
        with self._lock:
            return list(self._entries.values()) + [e for e, _ in self._queued.values()]

    def is_queued(self, name: str) -> bool:
        """Whether ``name`` is waiting to be written (``load`` serves it from RAM, at once)."""
        with self._lock:
            return name in self._queued

    def load(self, name: str) -> tuple[list[Any], list[int], str] | None:
        """The KV state, tokens and kind of an entry; None (and the file deleted) if it is
        missing, truncated or corrupt. Reads the file on the calling thread: the engine
        uses ``read_async`` and ``materialize`` instead."""
        with self._lock:
            entry = self._entries.get(name)
            queued = self._queued.get(name)
        if queued is not None:
            return self._from_queued(*queued)
        if entry is None:
            return None
        path = self.directory / f"{name}{_SUFFIX}"
        try:
            size = path.stat().st_size
            if size != entry.nbytes:
                raise ValueError(f"size {size} bytes, expected {entry.nbytes}")
            if _file_crc(path) != entry.crc:
                raise ValueError("checksum mismatch")
            import mlx.core as mx

            contents: Any = mx.load(str(path), return_metadata=True)
            arrays, metadata = contents
            tokens = np.asarray(arrays.pop("tokens"), dtype=np.int32)
            if not np.array_equal(tokens, entry.tokens):
                raise ValueError("tokens differ from the manifest")
            cache = deserialize(arrays, metadata)
        except Exception as e:
            self._drop_unreadable(name, path, e)
            return None
        with self._lock:
            entry.used = time.time()
            self._dirty = True
        self.hits += 1
        self.read_bytes += entry.nbytes
        return cache, entry.tokens.tolist(), entry.kind

    def _from_queued(self, entry: _Entry, job: _Job) -> tuple[list[Any], list[int], str]:
        arrays = {k: a for k, a in job.arrays.items() if k != "tokens"}
        self.hits += 1
        return deserialize(arrays, job.metadata), entry.tokens.tolist(), entry.kind

    def read_async(self, name: str, done: Any = None) -> Any:
        """Read and check an entry's file on the loader thread. Returns a future of a
        ``FileRead`` (None when the file is missing or damaged: then logged and deleted);
        ``done`` is called (on the loader thread) when it is ready."""
        from concurrent.futures import ThreadPoolExecutor

        if self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="prompt-cache-load")
        future = self._loader.submit(self._read, name)
        if done is not None:
            future.add_done_callback(lambda _: done())
        return future

    def _read(self, name: str) -> FileRead | None:
        with self._lock:
            entry = self._entries.get(name)
        if entry is None:
            return None
        path = self.directory / f"{name}{_SUFFIX}"
        try:
            buf = path.read_bytes()
            if len(buf) != entry.nbytes:
                raise ValueError(f"size {len(buf)} bytes, expected {entry.nbytes}")
            if zlib.crc32(buf) != entry.crc:
                raise ValueError("checksum mismatch")
            arrays, metadata = _parse_safetensors(buf)
            tokens = arrays.pop("tokens")[0].astype(np.int32)
            if not np.array_equal(tokens, entry.tokens):
                raise ValueError("tokens differ from the manifest")
        except Exception as e:
            self._drop_unreadable(name, path, e)
            return None
        return FileRead(name, arrays, metadata, tokens.tolist(), entry.kind, entry.nbytes)

    def materialize(self, read: FileRead) -> list[Any] | None:
        """The KV state of a file read by ``read_async``, as MLX arrays (engine thread: one
        copy from host memory, no file access). None if its contents do not parse."""
        import mlx.core as mx

        try:
            arrays = {}
            for key, (data, dtype) in read.arrays.items():
                a = mx.array(data)
                arrays[key] = a.view(mx.bfloat16) if dtype == "BF16" else a
            cache = deserialize(arrays, read.metadata)
            mx.eval([a for a in arrays.values()])
        except Exception as e:
            self._drop_unreadable(read.name, self.directory / f"{read.name}{_SUFFIX}", e)
            return None
        with self._lock:
            entry = self._entries.get(read.name)
            if entry is not None:
                entry.used = time.time()
                self._dirty = True
        self.hits += 1
        self.read_bytes += read.nbytes
        return cache

    def _drop_unreadable(self, name: str, path: Path, e: Exception) -> None:
        log(f"Prompt cache: dropping unreadable entry {path.name}: {type(e).__name__}: {e}")
        self.corrupt += 1
        self._remove(name)

    def covers(self, tokens: list[int]) -> bool:
        """Whether an entry already serves every token of ``tokens``."""
        p = np.asarray(tokens, dtype=np.int32)
        for e in self._candidates():
            if len(e.tokens) >= len(p) and (e.trimmable or len(e.tokens) == len(p)):
                if _common_prefix(e.tokens, p) == len(p):
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
            if self._pending >= self.max_pending:
                self.dropped += 1
                return False
        import mlx.core as mx

        arrays["tokens"] = mx.array(tokens, dtype=mx.int32)
        mx.eval(list(arrays.values()))  # before a slot is taken: a failure here leaks none
        with self._lock:
            if self._closed or self._pending >= self.max_pending:
                self.dropped += 1
                return False
            self._pending += 1
        job = _Job(np.asarray(tokens, dtype=np.int32), arrays, metadata, kind, trimmable)
        name = _entry_name(job.tokens)
        entry = _Entry(name, job.tokens, size, 0, kind, trimmable, time.time())
        with self._lock:
            self.pending_bytes += sum(a.nbytes for a in arrays.values())
            self._queued[name] = (entry, job)
        self._queue.put(job)
        return True

    @property
    def busy(self) -> bool:
        """Whether the writer queue is full (``save`` would drop a new entry)."""
        return self._pending >= self.max_pending

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is on disk and the manifest is current."""
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
        }

    def mark_closing(self) -> None:
        """Tell a server waiting for this folder that ``close`` is coming (the last writes
        are under way)."""
        self._folder.mark_closing()

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new saves, let the writer finish the queued ones and the manifest, then
        give the folder up. Waits at most ``timeout`` seconds and returns whether the folder
        was given up by then; otherwise the writer gives it up when its last write ends (or
        the process exits), so the next owner never deletes a file still being written."""
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

    # ---- writer thread -----------------------------------------------------------------

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
                self._pending -= 1
                self._queued.pop(_entry_name(job.tokens), None)
                self.pending_bytes -= sum(a.nbytes for a in job.arrays.values())
                job = None  # the arrays go now, not at the next job
            done = self._stopping and not self._pending
            if self._dirty and (done or self._queue.empty()):
                self._write_manifest_locked()
            self._idle.notify_all()
        return not done

    def _write(self, job: _Job) -> None:
        import mlx.core as mx

        name = _entry_name(job.tokens)
        tmp = self.directory / f"{_TMP_PREFIX}{name}-{os.getpid()}-{threading.get_ident()}"
        mx.save_safetensors(str(tmp), job.arrays, job.metadata)
        tmp = tmp.with_name(tmp.name + _SUFFIX)
        size, crc = tmp.stat().st_size, _file_crc(tmp)
        entry = _Entry(name, job.tokens, size, crc, job.kind, job.trimmable, time.time())
        with self._lock:
            os.replace(tmp, self.directory / f"{name}{_SUFFIX}")
            self._entries[name] = entry
            self.written_bytes += size
            self._dirty = True
            self._drop_covered_locked(entry)
            self._enforce_bound_locked()

    def _drop_covered_locked(self, new: _Entry) -> None:
        """A trimmable entry serves all its prefixes: shorter conversation entries go
        (system-prompt entries stay, as in the RAM tier)."""
        if not new.trimmable:
            return
        for e in list(self._entries.values()):
            if (
                e is not new
                and e.kind != "system"
                and len(e.tokens) < len(new.tokens)
                and _common_prefix(e.tokens, new.tokens) == len(e.tokens)
            ):
                self._delete_locked(e.name)

    def _enforce_bound_locked(self) -> None:
        total = sum(e.nbytes for e in self._entries.values())
        for e in sorted(self._entries.values(), key=lambda e: e.used):
            if total <= self.max_bytes:
                break
            total -= e.nbytes
            self._delete_locked(e.name)

    def _delete_locked(self, name: str) -> None:
        self._entries.pop(name, None)
        if self._released:  # the folder may be another cache's now
            return
        (self.directory / f"{name}{_SUFFIX}").unlink(missing_ok=True)
        self._dirty = True

    def _remove(self, name: str) -> None:
        with self._lock:
            self._delete_locked(name)

    def _write_manifest_locked(self) -> None:
        doc = {
            "version": FORMAT_VERSION,
            "entries": {n: e.to_json() for n, e in self._entries.items()},
        }
        tmp = self.directory / f"{_TMP_PREFIX}{MANIFEST}"
        try:
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, self.directory / MANIFEST)
            self._dirty = False
        except OSError as e:
            log(f"Prompt cache: could not write the manifest: {e}")
