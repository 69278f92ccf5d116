"""The CPUs this process may use."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """The CPUs this process may run on (a container's or ``taskset``'s set, where the
    system says; ``os.cpu_count()`` counts the whole machine's)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # macOS has no affinity call
        return os.cpu_count() or 1
