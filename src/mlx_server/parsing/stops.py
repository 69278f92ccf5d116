"""Stop strings: an incremental matcher that never lets a stop string (or its start) leak."""

from __future__ import annotations

from mlx_server.parsing.tags import find_first, held_tail_len


class StopMatcher:
    """Feed text pieces; get back the text that is safe to emit and the stop that matched.

    Only a suffix that could still grow into a stop string is held back.
    """

    def __init__(self, stops: tuple[str, ...] | list[str]):
        self.stops = tuple(s for s in stops if s)
        self._buf = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Return text safe to emit; after a match, ``matched`` is set and the rest is dropped."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        buf = self._buf + text
        hit = find_first(buf, self.stops)
        if hit is not None:
            self._buf = ""
            self.matched = hit[1]
            return buf[: hit[0]]
        keep = held_tail_len(buf, self.stops)
        self._buf = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """End of generation: whatever was held back is plain text."""
        out, self._buf = self._buf, ""
        return "" if self.matched is not None else out
