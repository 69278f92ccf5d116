"""Failures of the prefix cache's own bookkeeping, kept away from the requests.

Storing, evicting, writing or reading an entry is a service to later requests: when it
fails (a cache kind that cannot be copied or written, a full disk, a damaged file), the
entry is dropped and the request that triggered it, the requests beside it and the engine
go on. Each failure is counted; each distinct cause is logged once, so a cause that repeats
on every request does not flood the log.
"""

from __future__ import annotations

from mlx_server.logs import log

_MAX_CAUSES = 64  # distinct causes remembered (then new ones are counted, not logged)


class CacheFaults:
    """Counts failures and logs each distinct cause once."""

    def __init__(self) -> None:
        self.count = 0
        self._seen: set[tuple[str, str, str]] = set()

    def note(self, what: str, e: BaseException) -> None:
        """Record that ``what`` (e.g. "writing an entry to disk") failed with ``e``."""
        self.count += 1
        cause = (what, type(e).__name__, str(e)[:200])
        if cause in self._seen or len(self._seen) >= _MAX_CAUSES:
            return
        self._seen.add(cause)
        log(
            f"Prompt cache: {what} failed, the entry is dropped and requests go on "
            f"({type(e).__name__}: {e}); further failures of this kind are only counted "
            "(prompt_cache_failures)"
        )
