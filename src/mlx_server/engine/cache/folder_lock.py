"""An exclusive advisory lock on a folder, so that one open disk tier at a time uses it.

The lock is ``flock`` on a file inside the folder, taken without blocking. ``flock`` locks
belong to an open file, not to a process: a second lock object in the same process is
refused as well, and the kernel drops the lock when the holder closes the file or dies
(``kill -9`` included), so a crash never leaves a stale lock behind. It works on macOS and
Linux (``fcntl.flock``).

The holder writes its pid into the file, and marks it as closing while it shuts down, so
that the next one can say who holds the folder, and wait for a holder that is about to let
it go (a server restarted while the old process still writes its last entries).
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

LOCK_FILE = "lock"
_CLOSING = "closing"
_POLL_S = 0.05


class FolderLocked(OSError):
    """The folder is held by another lock: ``pid`` (None if it has not written it yet)."""

    def __init__(self, directory: Path, pid: int | None, closing: bool):
        self.directory, self.pid, self.closing = directory, pid, closing
        holder = f"pid {pid}" if pid is not None else "another process"
        super().__init__(f"{directory} is locked by {holder}")


class FolderLock:
    """A held lock on a folder; ``release`` (or the process ending) gives it up."""

    def __init__(self, fd: int, directory: Path):
        self._fd: int | None = fd
        self.directory = directory
        # A note and the release come from different threads (``close`` marks the folder
        # closing while the disk tier's writer may give it up): never a write to a closed fd.
        self._guard = threading.Lock()

    @classmethod
    def acquire(cls, directory: Path, wait_closing_s: float = 0.0) -> FolderLock:
        """Lock ``directory`` (which must exist) or raise ``FolderLocked`` at once; a holder
        that is closing is waited for, at most ``wait_closing_s`` seconds."""
        fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + wait_closing_s
        try:
            while not _try_lock(fd):
                pid, closing = _read_note(fd)
                if not closing or time.monotonic() >= deadline:
                    raise FolderLocked(directory, pid, closing)
                time.sleep(_POLL_S)
        except BaseException:
            os.close(fd)
            raise
        lock = cls(fd, directory)
        lock._write_note(str(os.getpid()))
        return lock

    def mark_closing(self) -> None:
        """Tell a process waiting for the folder that it will be released soon."""
        self._write_note(f"{os.getpid()} {_CLOSING}")

    def release(self) -> None:
        """Give the folder up (closing the file drops the lock); idempotent."""
        with self._guard:
            fd, self._fd = self._fd, None
            if fd is not None:
                os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _write_note(self, text: str) -> None:
        with self._guard:
            if self._fd is None:  # released: nothing to tell
                return
            try:
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, f"{text}\n".encode(), 0)
            except OSError:
                pass  # the note only serves messages: the lock itself is held


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # EWOULDBLOCK: someone holds it
        return False
    return True


def _read_note(fd: int) -> tuple[int | None, bool]:
    """The holder's pid and whether it is closing, from the lock file."""
    try:
        words = os.pread(fd, 64, 0).decode("ascii", "replace").split()
    except OSError:
        return None, False
    pid = int(words[0]) if words and words[0].isdigit() else None
    return pid, _CLOSING in words[1:]
