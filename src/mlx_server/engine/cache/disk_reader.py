"""The disk tier's reads: an entry's file checked (size, CRC-32, tokens) and turned back
into a KV state, on the calling thread (``load``) or on the loader thread into host arrays
that the engine thread then makes MLX arrays of (``read_async``, ``materialize``). A file
that fails any check is logged, deleted and a miss. See ``disk.py``."""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlx_server.engine.cache.disk_index import DiskState, Entry, WriteJob, file_crc
from mlx_server.engine.cache.serialize import deserialize
from mlx_server.logs import log


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


def parse_safetensors(buf: bytes) -> tuple[dict[str, tuple[np.ndarray, str]], dict[str, str]]:
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


class DiskReads(DiskState):
    """The reading half of ``DiskPromptCache``."""

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
        path = self.path_of(name)
        try:
            size = path.stat().st_size
            if size != entry.nbytes:
                raise ValueError(f"size {size} bytes, expected {entry.nbytes}")
            if file_crc(path) != entry.crc:
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

    def _from_queued(self, entry: Entry, job: WriteJob) -> tuple[list[Any], list[int], str]:
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
        path = self.path_of(name)
        try:
            buf = path.read_bytes()
            if len(buf) != entry.nbytes:
                raise ValueError(f"size {len(buf)} bytes, expected {entry.nbytes}")
            if zlib.crc32(buf) != entry.crc:
                raise ValueError("checksum mismatch")
            arrays, metadata = parse_safetensors(buf)
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
            self._drop_unreadable(read.name, self.path_of(read.name), e)
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
