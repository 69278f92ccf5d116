"""Tag search over streamed text: where a tag starts, and how much of a tail to hold back."""

from __future__ import annotations

from collections.abc import Iterable


def find_first(text: str, tags: Iterable[str], start: int = 0) -> tuple[int, str] | None:
    """Return ``(position, tag)`` of the earliest occurrence of any non-empty tag, or None.

    When two tags start at the same position the longer one wins, so a tag that is a
    prefix of another never shadows it.
    """
    best: tuple[int, str] | None = None
    for tag in tags:
        if not tag:
            continue
        pos = text.find(tag, start)
        if pos < 0:
            continue
        if best is None or pos < best[0] or (pos == best[0] and len(tag) > len(best[1])):
            best = (pos, tag)
    return best


def held_tail_len(text: str, tags: Iterable[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``tags``.

    That suffix could still become a tag once more text arrives, so it must not be emitted
    yet; everything before it is safe.
    """
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best
