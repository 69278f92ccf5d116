"""Find where a streamed JSON object ends without parsing it.

Tool-call arguments are streamed as the raw JSON text the model writes; the scanner tracks
nesting depth and string/escape state so that it knows the exact character that closes the
object, even when strings hold braces, quotes or tags. Also the two JSON checks the
tool-call parser makes of a call: its header's name and whether its arguments are whole,
and ``loads``, the JSON parse of text inside a request or a model's output.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any


class ScanStatus(Enum):
    MORE = "more"  # consumed everything; the object is still open
    CLOSED = "closed"  # the object closed at the last consumed character
    STOPPED = "stopped"  # halted before a stop character outside any string


class JsonObjectScanner:
    """Incremental scanner over text that starts with a JSON object's ``{``."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self._escape = False
        self.closed = False

    def scan(self, text: str, stop: str = "") -> tuple[int, ScanStatus]:
        """Consume ``text`` until the object closes or a ``stop`` character appears outside a
        string; return how many characters were consumed and why it returned.

        A stop character is left unconsumed so the caller can look at what follows it (for
        instance an end tag that shows the JSON was cut short).
        """
        for i, ch in enumerate(text):
            if self.in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self.in_string = False
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.closed = True
                    return i + 1, ScanStatus.CLOSED
            elif stop and ch in stop:
                return i, ScanStatus.STOPPED
        return len(text), ScanStatus.MORE


def loads(text: str | bytes) -> Any:
    """``json.loads``, where text nested deeper than the interpreter's stack allows is a
    ``JSONDecodeError`` (a ValueError) like any other text that is not JSON: the request
    body's depth check does not see inside a string (a tool call's ``arguments``), and
    ``json.loads`` raises RecursionError there."""
    try:
        return json.loads(text)
    except RecursionError:
        doc = text if isinstance(text, str) else text.decode("utf-8", "replace")
        raise json.JSONDecodeError("nested too deeply", doc, 0) from None


def header_name(m: Any) -> str | None:
    """The function name a call header matched (group ``name``, a JSON string's
    contents, escapes decoded), or None when empty or not valid JSON."""
    raw = m.group("name")
    if "\\" not in raw:
        return raw or None
    try:
        name = loads(f'"{raw}"')
    except json.JSONDecodeError:
        return None
    return name if isinstance(name, str) and name else None


def is_json_object(text: str) -> bool:
    """Whether ``text`` is one whole JSON object."""
    try:
        return isinstance(loads(text), dict)
    except json.JSONDecodeError:
        return False
