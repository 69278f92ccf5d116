"""Incremental parsing of functionary v3.2 output: messages addressed with ``>>>``.

The prompt ends with ``>>>``, so the output starts with a recipient line, then the message;
later messages start with ``>>>`` again::

    all
    Let me look that up.>>>get_weather
    {"city": "Paris"}

``all`` addresses the user (content); a function name is a tool call whose body is its JSON
arguments (streamed as they arrive); ``python`` is a call of an offered ``python`` tool with
the code as ``{"code": ...}``. A recipient the request did not offer is text, written as the
model wrote it. Output whose first line is not a plausible recipient is plain content.
"""

from __future__ import annotations

import json
import re

from mlx_server.events import OutputEvent, TextDelta, ToolCallArgsDelta, ToolCallEnd
from mlx_server.parsing.call_decoder import MessageParser
from mlx_server.parsing.tags import hold_trailing_space

SEPARATOR = ">>>"
_RECIPIENT = re.compile(r"[A-Za-z_][\w.-]*")
_MAX_RECIPIENT = 128

_HEADER = "header"
_BODY = "body"

# Detection: ``>>>all`` messages and the ``>>>`` before each call (quotes read as ``'``).
template_markers = ((">>>all", "'>>>' + tool_call"),)


class FunctionaryParser(MessageParser):
    """Incremental decoder of functionary v3.2 output into text and tool-call events."""

    def _begin(self) -> None:
        self._state = _HEADER
        self._recipient = "all"
        self._call: int | None = None
        self._code: list[str] | None = None  # a python call's code, sent at its end
        self._args: list[str] = []
        self._held = ""  # trailing whitespace of the body, dropped if the message ends
        self._texted = False  # content was emitted (a later text message is joined)

    def flush(self) -> list[OutputEvent]:
        out: list[OutputEvent] = []
        buf, self._buf = self._buf, ""
        if self._state == _HEADER:
            if buf.strip():
                self._open("all")
                self._body(out, buf)
        else:
            self._body(out, buf)
        self._end(out)
        return out

    def _step(self, out: list[OutputEvent]) -> bool:
        if self._state == _HEADER:
            pos = self._buf.find("\n")
            if pos < 0:
                if len(self._buf) > _MAX_RECIPIENT or not _RECIPIENT.fullmatch(
                    self._buf.strip() or "a"
                ):
                    self._open("all")  # not a recipient line: plain content
                    return True
                return False
            recipient, rest = self._buf[:pos].strip(), self._buf[pos + 1 :]
            if not _RECIPIENT.fullmatch(recipient):
                self._open("all")
                return True
            self._buf = rest
            self._open(recipient, out)
            return True
        text, tag = self._take_until([SEPARATOR])
        self._body(out, text)
        if tag is None:
            return False
        self._buf = self._buf[len(tag) :]
        self._end(out)
        self._state = _HEADER
        return True

    def _open(self, recipient: str, out: list[OutputEvent] | None = None) -> None:
        self._state = _BODY
        self._recipient = recipient
        self._held = ""
        self._args = []
        self._code = None
        if recipient == "all" or recipient not in self._names or out is None:
            if recipient != "all" and out is not None:  # not offered: keep what was written
                out.append(TextDelta(f"{SEPARATOR if self._texted else ''}{recipient}\n"))
                self._texted = True
            self._call = None
            return
        index = self._start_call(out, recipient)
        self._call = -1 if index is None else index  # -1: dropped
        if index is not None and recipient == "python":
            self._code = []

    def _body(self, out: list[OutputEvent], text: str) -> None:
        body, self._held = hold_trailing_space(text, self._held, drop_leading=False)
        if not body:
            return
        if self._call is None:
            out.append(TextDelta(body))
            self._texted = True
        elif self._call < 0:
            return
        elif self._code is not None:
            self._code.append(body)
        else:
            if not self._args:
                body = body.lstrip()
            self._args.append(body)
            out.append(ToolCallArgsDelta(index=self._call, text=body))

    def _end(self, out: list[OutputEvent]) -> None:
        if self._call is not None and self._call >= 0:
            if self._code is not None:
                arguments = json.dumps({"code": "".join(self._code)}, ensure_ascii=False)
                out.append(ToolCallArgsDelta(index=self._call, text=arguments))
            else:
                arguments = "".join(self._args)
            out.append(ToolCallEnd(index=self._call, arguments=arguments))
        self._call = None
        self._code = None
        self._args = []
        self._held = ""


message_parser = FunctionaryParser
