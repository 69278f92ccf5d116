"""The wired limit (Metal: memory the system keeps resident for this process), set once per
process from the sum of what the loaded models claim.

mlx-lm's ``BatchGenerator`` sets the limit to the device's recommended working set when it
is made and restores the previous value when it is closed. With several generators (a runner
starting over, the warm-up's own, several models) the restores come out of order — load A,
load B, close A: the limit drops to what it was before A while B runs — and on Metal the
restore synchronizes, so a stored GPU error raised there would escape a generator's close.
Here each engine claims its models' bytes when it starts and gives them back when it stops;
generators are made ``hands_off`` so they never touch the limit. Off Metal (no recommended
working set) there is no limit to set.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_claimed = 0


def _recommended() -> int | None:
    import mlx.core as mx

    try:
        info = mx.device_info() if hasattr(mx, "device_info") else {}
    except Exception:
        return None
    size = info.get("max_recommended_working_set_size")
    return int(size) if size else None


def _apply(n_bytes: int) -> None:
    import mlx.core as mx

    mx.set_wired_limit(n_bytes)


def claim(n_bytes: int) -> int | None:
    """Add ``n_bytes`` (a model's weights and KV budget) to the process's wired limit, capped
    at the recommended working set. Returns the limit set, or None off Metal."""
    global _claimed
    with _lock:
        _claimed += max(0, n_bytes)
        return _set()


def release(n_bytes: int) -> int | None:
    """Give back what ``claim`` took (a model unloaded or an engine stopped)."""
    global _claimed
    with _lock:
        _claimed = max(0, _claimed - max(0, n_bytes))
        return _set()


def _set() -> int | None:
    cap = _recommended()
    if cap is None:
        return None
    limit = min(cap, _claimed)
    _apply(limit)
    return limit


def hands_off(generator: Any) -> Any:
    """Stop a ``BatchGenerator`` from restoring the wired limit it found (mlx-lm keeps it in
    ``_old_wired_limit``; tests/engine/test_mlx_lm_contract.py pins the name), and put back the
    process's own limit, which the generator replaced with the whole working set."""
    if generator._old_wired_limit is not None:
        generator._old_wired_limit = None
        with _lock:
            _set()
    return generator
