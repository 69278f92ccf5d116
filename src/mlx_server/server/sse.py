"""The one Server-Sent Events framer every streaming API writes through."""

from __future__ import annotations

import json
from dataclasses import dataclass
from json.encoder import encode_basestring  # the string as json.dumps writes it
from typing import Any

HEADERS = {"Cache-Control": "no-cache", "Connection": "keep-alive", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class RawJSON:
    """A JSON text already encoded: a stream's most frequent frames are made from a
    template instead of a dictionary serialised per token."""

    text: bytes


class TextTemplate:
    """A JSON value with one string slot (``SLOT``, the last one it serialises): ``fill(text)``
    gives the bytes ``json.dumps(value, ensure_ascii=False)`` writes with ``text`` in the slot,
    without serialising the rest again (a stream's per-token chunks differ only in it)."""

    SLOT = "\x00"

    def __init__(self, value: Any):
        before, sep, after = _json(value).rpartition(b'"\\u0000"')
        if not sep:
            raise ValueError("the value has no slot")
        self.before, self.after = before, after

    def fill(self, text: str) -> RawJSON:
        return RawJSON(self.before + encode_basestring(text).encode() + self.after)


@dataclass(frozen=True)
class Frame:
    """One SSE block: a ``data`` line (a JSON value, or a literal string such as ``[DONE]``)
    with an optional ``event`` name; or a ``comment`` line; or an ``error`` line."""

    data: Any = None
    event: str | None = None
    comment: str | None = None
    # A failure mid-stream as the Swift mlx-server writes it, ``error: {"message": ...}``:
    # Jan's stream reader acts on it; standard SSE clients ignore the unknown field.
    error: str | None = None


def encode(frame: Frame) -> bytes:
    data = frame.data
    if type(data) is RawJSON and frame.event is None:  # the hot path: a content chunk
        return b"data: " + data.text + b"\n\n"
    if frame.comment is not None:
        return f": {frame.comment}\n\n".encode()
    if frame.error is not None:
        return b"error: " + _json({"message": frame.error}) + b"\n\n"
    if isinstance(data, RawJSON):
        data = data.text
    else:
        data = data.encode() if isinstance(data, str) else _json(data)
    head = f"event: {frame.event}\n".encode() if frame.event else b""
    return head + b"data: " + data + b"\n\n"


# One encoder for every frame: ``json.dumps`` with options builds a new one per call.
json_text = json.JSONEncoder(ensure_ascii=False).encode


def _json(value: Any) -> bytes:
    return json_text(value).encode()
