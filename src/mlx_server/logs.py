"""``[mlx]``-prefixed log lines on stdout, flushed line by line (Jan's launcher reads them)."""

from __future__ import annotations

import sys
import threading

_lock = threading.Lock()


def log(message: str) -> None:
    """Write one ``[mlx] message`` line to stdout and flush it at once."""
    line = f"[mlx] {message}\n"
    with _lock:
        try:
            sys.stdout.write(line)
            sys.stdout.flush()
        except (OSError, ValueError):
            pass  # stdout closed (parent went away): logging must never crash a request
