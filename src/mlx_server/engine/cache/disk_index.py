"""The disk tier's bookkeeping: its entries, their names, the manifest, and the state the
engine, loader and writer threads share (``DiskState``). See ``disk.py``."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import queue
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlx_server.engine.cache.folder_lock import FolderLock
from mlx_server.engine.cache.serialize import FORMAT_VERSION
from mlx_server.logs import log

MANIFEST = "index.json"
SUFFIX = ".safetensors"
TMP_PREFIX = ".tmp-"
_CHUNK = 8 << 20


@dataclass
class Entry:
    """One state on disk (or queued to be): its tokens, file size and CRC-32, kind."""

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
    def from_json(cls, name: str, d: dict[str, Any]) -> Entry:
        tokens = np.frombuffer(base64.b64decode(d["tokens"]), dtype="<i4").astype(np.int32)
        return cls(
            name, tokens, int(d["bytes"]), int(d["crc"]), str(d["kind"]), bool(d["trimmable"]),
            float(d["used"]),
        )  # fmt: skip


@dataclass
class WriteJob:
    """A state handed to the writer: its evaluated arrays (tokens included)."""

    tokens: np.ndarray
    arrays: dict[str, Any]
    metadata: dict[str, str]
    kind: str
    trimmable: bool


class DiskState:
    """What the disk tier's parts share (set up by ``DiskPromptCache.__init__``): the
    entries and queued writes under ``_lock``, the counters, the folder and its threads."""

    directory: Path
    max_bytes: int
    max_pending: int
    hits: int
    misses: int
    corrupt: int
    dropped: int
    read_bytes: int
    written_bytes: int
    pending_bytes: int
    _lock: threading.Lock
    _idle: threading.Condition
    _pending: int
    _dirty: bool
    _queue: queue.Queue[WriteJob | None]
    _queued: dict[str, tuple[Entry, WriteJob]]
    _settling: list[tuple[int, WriteJob]]
    _settled: int
    _closing: bool
    _saver: int | None  # the thread that saves (and settles): the engine's
    _entries: dict[str, Entry]
    _loader: Any
    _closed: bool
    _stopping: bool
    _released: bool
    _folder: FolderLock
    _writer: threading.Thread

    def path_of(self, name: str) -> Path:
        return self.directory / f"{name}{SUFFIX}"

    def _delete_locked(self, name: str) -> None:
        self._entries.pop(name, None)
        if self._released:  # the folder may be another cache's now
            return
        self.path_of(name).unlink(missing_ok=True)
        self._dirty = True

    def _remove(self, name: str) -> None:
        with self._lock:
            self._delete_locked(name)


def file_crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def entry_name(tokens: np.ndarray) -> str:
    return hashlib.sha256(tokens.tobytes()).hexdigest()[:32]


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def read_manifest(directory: Path) -> tuple[dict[str, Entry], bool]:
    """The manifest's entries whose file exists with the listed size, and whether the
    manifest must be written again; temporary and unlisted files (left by a crash) are
    deleted."""
    entries: dict[str, Entry] = {}
    try:
        doc = json.loads((directory / MANIFEST).read_text())
        if doc.get("version") == FORMAT_VERSION:
            for name, d in doc.get("entries", {}).items():
                entries[name] = Entry.from_json(name, d)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as e:
        log(f"Prompt cache: ignoring an unreadable manifest in {directory} ({e})")
    on_disk = {}
    for f in directory.iterdir():
        if f.name.startswith(TMP_PREFIX) or (f.suffix == SUFFIX and f.stem not in entries):
            f.unlink(missing_ok=True)
        elif f.suffix == SUFFIX:
            on_disk[f.stem] = f.stat().st_size
    kept = {n: e for n, e in entries.items() if on_disk.get(n) == e.nbytes}
    for name in on_disk.keys() - kept.keys():
        (directory / f"{name}{SUFFIX}").unlink(missing_ok=True)
    return kept, len(kept) != len(entries)


def write_manifest(directory: Path, entries: dict[str, Entry]) -> bool:
    """Write the manifest (to a temporary name, then renamed); whether it was written."""
    doc = {"version": FORMAT_VERSION, "entries": {n: e.to_json() for n, e in entries.items()}}
    tmp = directory / f"{TMP_PREFIX}{MANIFEST}"
    try:
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, directory / MANIFEST)
        return True
    except OSError as e:
        log(f"Prompt cache: could not write the manifest: {e}")
        return False
