"""Stop strings: an incremental matcher that never lets a stop string (or its start) leak."""

from __future__ import annotations


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
        hit = -1
        for s in self.stops:
            i = buf.find(s)
            if i != -1 and (hit == -1 or i < hit):
                hit, self.matched = i, s
        if hit != -1:
            self._buf = ""
            return buf[:hit]
        keep = self._held_suffix(buf)
        self._buf = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """End of generation: whatever was held back is plain text."""
        out, self._buf = self._buf, ""
        return "" if self.matched is not None else out

    def _held_suffix(self, buf: str) -> int:
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
