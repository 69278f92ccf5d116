"""``[mlx]``-prefixed log lines on stdout, flushed line by line (Jan's launcher reads them)."""

from __future__ import annotations

import sys
import threading

_lock = threading.Lock()
_prefix = ""  # "rank 1: " on the other ranks of a sharded server (their lines share stdout)


def set_prefix(prefix: str) -> None:
    """Start every later line with ``prefix`` (after ``[mlx] ``)."""
    global _prefix
    _prefix = prefix


def log(message: str) -> None:
    """Write one ``[mlx] message`` line to stdout and flush it at once."""
    line = f"[mlx] {_prefix}{message}\n"
    with _lock:
        try:
            sys.stdout.write(line)
            sys.stdout.flush()
        except (OSError, ValueError):
            pass  # stdout closed (parent went away): logging must never crash a request


def load_failed(message: str) -> int:
    """Say why the model could not be served (the log line Jan's launcher reads, and the
    error on stderr); returns the exit status."""
    log(f"Failed to load model: {message}")
    print(f"Error: {message}", file=sys.stderr, flush=True)
    return 1
