"""Tag search over streamed text: where a tag starts, and how much of a tail to hold back."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

E = TypeVar("E")


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
    # Such a suffix starts with the tag's first character within the tag's length of the
    # end: a search for that character (usually absent) instead of a comparison per length.
    best = 0
    end = len(text)
    for tag in tags:
        size = len(tag)
        if size < 2:
            continue
        first = tag[0]
        pos = text.find(first, max(end - size + 1, 0), end - best)
        while pos >= 0:
            if tag.startswith(text[pos:]):
                best = end - pos
                break
            pos = text.find(first, pos + 1, end - best)
    return best


def hold_trailing_space(text: str, held: str, *, drop_leading: bool) -> tuple[str, str]:
    """Split streamed text of one segment into what to emit now and the whitespace to hold:
    ``(body, held)``. Whitespace at the segment's end is held (``held`` is the part held
    so far) because it is dropped if a tag follows, and emitted before the next text
    otherwise; ``drop_leading`` drops the text's leading whitespace first."""
    if drop_leading:
        text = text.lstrip()
    if not text:
        return "", held
    text = held + text
    body = text.rstrip()
    return body, text[len(body) :]


class MarkerStripper:
    """Removes literal markers from streamed text (Command R7B's ``<|START_RESPONSE|>``,
    Granite's ``<response>``), holding back only a tail that could still become one."""

    def __init__(self, markers: Iterable[str]) -> None:
        self._markers = [m for m in markers if m]
        self._buf = ""

    def feed(self, text: str) -> str:
        """The text that is certain, without markers."""
        self._buf += text
        out = []
        while (hit := find_first(self._buf, self._markers)) is not None:
            pos, tag = hit
            out.append(self._buf[:pos])
            self._buf = self._buf[pos + len(tag) :]
        cut = len(self._buf) - held_tail_len(self._buf, self._markers)
        out.append(self._buf[:cut])
        self._buf = self._buf[cut:]
        return "".join(out)

    def flush(self) -> str:
        """What was held back: it never became a marker."""
        buf, self._buf = self._buf, ""
        return buf


class SteppedDecoder(Generic[E]):
    """The plumbing every incremental output parser shares (the shape of httpx's decoders):
    ``feed`` appends to a buffer and runs ``_step`` until it can consume no more (the rest
    may be the start of a tag); subclasses write ``_step`` and ``flush``."""

    def __init__(self) -> None:
        self._buf = ""  # input not yet consumed

    def feed(self, text: str) -> list[E]:
        """Consume a piece of generated text; return the events that are now certain."""
        self._buf += text
        out: list[E] = []
        while self._step(out):
            pass
        return out

    def _take_until(self, tags: Iterable[str]) -> tuple[str, str | None]:
        """Take the buffered text before the earliest of ``tags`` and say which tag is now at
        the buffer's start; with none found, take all but a tail that could still become
        one, and say None."""
        tags = list(tags)
        hit = find_first(self._buf, tags)
        cut = hit[0] if hit else len(self._buf) - held_tail_len(self._buf, tags)
        text, self._buf = self._buf[:cut], self._buf[cut:]
        return text, hit[1] if hit else None

    def _step(self, out: list[E]) -> bool:
        """Consume what can be consumed into ``out``; True when another step may follow."""
        raise NotImplementedError

    def flush(self) -> list[E]:
        """End of generation: emit whatever was held back."""
        raise NotImplementedError
