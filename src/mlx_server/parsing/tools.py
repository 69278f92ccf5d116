"""Incremental tool-call parsing of generated answer text.

``ToolCallParser`` finds a format's call markers in the text, streams the text around them
as ``TextDelta`` and turns each call into ``ToolCallStart`` / ``ToolCallArgsDelta`` /
``ToolCallEnd``. The call text itself is parsed by mlx-lm's parser for the format.

- Formats with a JSON arguments object after a short header (``json_tools``, ``mistral``,
  ``llama3_json``) stream the arguments as the raw JSON text arrives, ending exactly at the
  object's close; several objects in one block are several calls. Other formats emit the
  arguments in one piece when the call's end marker arrives (or at ``flush`` when the
  format has no end marker). A block whose header does not match is parsed whole.
- A block that does not parse, or that calls a function the request did not offer, is
  returned as ``TextDelta`` with its markers, so nothing the model wrote is lost.
- Whitespace next to a call is dropped: trailing whitespace of the text before it, leading
  whitespace of the text after it, whitespace-only text between calls.
- ``max_calls`` keeps the first N calls; later ones are dropped (not shown as text).
- A streamed call cut short (end of output, or its end marker inside unclosed JSON) still
  ends with ``ToolCallEnd`` carrying the raw, incomplete arguments: already-sent pieces
  cannot be taken back, and the finish reason tells the client the output was cut.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlx_server.events import OutputEvent, TextDelta, ToolCallArgsDelta, ToolCallEnd
from mlx_server.logs import log
from mlx_server.parsing.call_decoder import CallDecoder, new_call_id, normalize_call
from mlx_server.parsing.json_scan import JsonObjectScanner, ScanStatus, header_name, is_json_object
from mlx_server.parsing.tags import find_first, held_tail_len, hold_trailing_space
from mlx_server.parsing.tool_formats import ToolFormat
from mlx_server.parsing.tool_schema import tool_names

_TEXT = "text"  # answer text; looking for a call's start marker
_BODY = "body"  # inside a call block, collecting it until its end marker
_ARGS = "args"  # streaming a JSON arguments object
_CLOSER = "closer"  # arguments closed; skipping what closes the header's brackets
_TAIL = "tail"  # skipping the rest of a block up to its end marker


class ToolCallParser(CallDecoder):
    """Incremental decoder of answer text into text and tool-call events."""

    def __init__(
        self,
        fmt: ToolFormat,
        tools: list[dict[str, Any]] | None,
        *,
        id_factory: Callable[[], str] = new_call_id,
        max_calls: int | None = None,
    ) -> None:
        """``tools``: the request's tool list (OpenAI form); calls to other names stay text.
        None accepts any name. ``max_calls``: keep only the first N calls."""
        super().__init__(id_factory=id_factory, max_calls=max_calls)
        self._fmt = fmt
        self._tools = tools
        self._names = tool_names(tools) if tools is not None else None
        self._state = _TEXT
        # The text segment between calls.
        self._fresh = True  # nothing emitted in this segment yet
        self._after_call = False  # the segment follows a call
        self._held_ws = ""  # trailing whitespace that may turn out to precede a call
        self._bare_checked = not fmt.bare_start  # looked for a call without start marker
        # The current call block.
        self._prefix = ""  # the start marker that opened it, for returning it as text
        self._searched = 0  # how far the end marker was already searched for
        self._header_failed = True
        self._continued = False  # the block goes on after a streamed call, inside its markers
        # The current streamed call.
        self._scanner = JsonObjectScanner()
        self._args: list[str] = []
        self._index: int | None = None  # None: the call is dropped (max_calls)

    def flush(self) -> list[OutputEvent]:
        """End of output: finish or return as text whatever is pending."""
        out: list[OutputEvent] = []
        buf, self._buf = self._buf, ""
        if self._state == _TEXT:
            self._emit_text(out, buf)
        elif self._state == _BODY:
            self._finish_block(out, buf, closed=False)
        elif self._state == _ARGS:
            self._add_args(out, buf)
            self._end_streamed(out)
        self._state = _TEXT
        if self._held_ws:  # no call after it: it is part of the text
            out.append(TextDelta(self._held_ws))
            self._held_ws = ""
        return out

    def interrupt(self) -> list[OutputEvent]:
        """The answer text is interrupted (a reasoning block comes between): a start marker
        cannot span the gap, so a held partial marker is released as text."""
        if self._state != _TEXT or not self._buf:
            return []
        out: list[OutputEvent] = []
        buf, self._buf = self._buf, ""
        self._emit_text(out, buf)
        return out

    # -- states; each returns True when it changed state and another step may follow

    def _step(self, out: list[OutputEvent]) -> bool:
        if self._state == _TEXT:
            return self._step_text(out)
        if self._state == _BODY:
            return self._step_body(out)
        if self._state == _ARGS:
            return self._step_args(out)
        if self._state == _TAIL:
            return self._step_tail(out)
        return self._step_closer()

    def _step_text(self, out: list[OutputEvent]) -> bool:
        if not self._bare_checked:
            return self._step_bare_start()
        start = self._fmt.start
        text, tag = self._take_until([start])
        self._emit_text(out, text)
        if tag is None:
            return False
        self._buf = self._buf[len(start) :]
        self._open_block(start)
        return True

    def _step_bare_start(self) -> bool:
        """At the start of the answer, a JSON object may be a call without start marker."""
        rest = self._buf.lstrip()
        if not rest:
            return False
        self._bare_checked = True
        if rest.startswith("{"):
            self._held_ws += self._buf[: len(self._buf) - len(rest)]
            self._buf = rest
            self._open_block("")
        return True

    def _step_body(self, out: list[OutputEvent]) -> bool:
        if not self._header_failed:
            if self._try_header(out):
                return True
            if not self._header_failed:
                return False  # the header may still complete
            if self._continued:  # not another call: skip to the block's end marker
                self._state = _TAIL
                return True
            if not self._prefix:  # a block guessed without start marker is text after all
                self._state = _TEXT
                return True
        end = self._fmt.end
        if not end:
            return False  # the block runs to the end of the output
        pos = self._buf.find(end, max(0, self._searched - len(end) + 1))
        if pos < 0:
            self._searched = len(self._buf)
            return False
        body, self._buf = self._buf[:pos], self._buf[pos + len(end) :]
        self._finish_block(out, body, closed=True)
        return True

    def _step_args(self, out: list[OutputEvent]) -> bool:
        end = self._fmt.end
        n, status = self._scanner.scan(self._buf, stop="<" if end else "")
        self._add_args(out, self._buf[:n])
        self._buf = self._buf[n:]
        if status is ScanStatus.CLOSED:
            self._end_streamed(out)
            self._state = _CLOSER
            return True
        if status is ScanStatus.MORE:
            return False
        if self._buf.startswith(end):  # end marker inside unclosed JSON: cut short
            self._buf = self._buf[len(end) :]
            self._end_streamed(out)
            self._state = _TEXT
            return True
        if end.startswith(self._buf):
            return False  # may be the end marker; wait
        self._add_args(out, self._buf[0])  # a stray "<" is just part of the arguments
        self._buf = self._buf[1:]
        return True

    def _step_tail(self, out: list[OutputEvent]) -> bool:
        # A new start marker also ends the skipped tail, in case the end marker was omitted.
        hit = find_first(self._buf, [self._fmt.end, self._fmt.start])
        if hit is None:
            markers = [self._fmt.end, self._fmt.start]
            self._buf = self._buf[len(self._buf) - held_tail_len(self._buf, markers) :]
            return False
        pos, tag = hit
        self._buf = self._buf[pos:] if tag == self._fmt.start else self._buf[pos + len(tag) :]
        self._state = _TEXT
        return True

    def _step_closer(self) -> bool:
        rest = self._buf.lstrip()
        closer = self._fmt.stream_closer
        if not rest or (closer.startswith(rest) and rest != closer):
            self._buf = rest
            return False
        self._buf = rest[len(closer) :] if closer and rest.startswith(closer) else rest
        # Another call may follow: in the same block (several JSON objects in one
        # <tool_call>) or, for formats without end marker, right after this one.
        self._open_block("", continued=bool(self._fmt.end))
        return True

    # -- call blocks

    def _open_block(self, prefix: str, *, continued: bool = False) -> None:
        self._state = _BODY
        self._prefix = prefix
        self._continued = continued
        self._searched = 0
        self._header_failed = self._fmt.stream_header is None

    def _try_header(self, out: list[OutputEvent]) -> bool:
        """Start a streamed call once the header is complete; True when it did."""
        m = self._fmt.stream_header.match(self._buf, partial=True)
        if m is not None and m.partial and not (self._fmt.end and self._fmt.end in self._buf):
            return False
        name = header_name(m) if m is not None and not m.partial else None
        if name is None or not self._accepts(name):
            self._header_failed = True  # parse the whole block at its end instead
            return False
        self._buf = self._buf[m.end() - 1 :]  # from the arguments' opening brace
        self._begin_call(out, name)
        self._scanner = JsonObjectScanner()
        self._args = []
        self._state = _ARGS
        return True

    def _finish_block(self, out: list[OutputEvent], body: str, *, closed: bool) -> None:
        self._state = _TEXT
        calls = self._parse(body)
        if calls is None:
            if body.strip() or self._prefix:
                self._emit_text(out, self._prefix + body + (self._fmt.end if closed else ""))
            return
        for name, arguments in calls:
            self._begin_call(out, name)
            self._add_args(out, arguments)
            self._end_call(out, arguments)

    def _parse(self, body: str) -> list[tuple[str, str]] | None:
        try:
            result = self._fmt.parse(body, self._tools)
        except Exception:  # mlx-lm parsers raise various errors on text that is no call
            return None
        items = result if isinstance(result, list) else [result]
        calls = [normalize_call(item) for item in items]
        if not calls or any(c is None or not self._accepts(c[0]) for c in calls):
            return None
        return [c for c in calls if c is not None]

    def _accepts(self, name: str) -> bool:
        return self._names is None or name in self._names

    # -- call events

    def _begin_call(self, out: list[OutputEvent], name: str) -> None:
        self._held_ws = ""  # whitespace before a call is not content
        self._index = self._start_call(out, name)

    def _add_args(self, out: list[OutputEvent], text: str) -> None:
        if not text:
            return
        self._args.append(text)
        if self._index is not None:
            out.append(ToolCallArgsDelta(index=self._index, text=text))

    def _end_streamed(self, out: list[OutputEvent]) -> None:
        arguments = "".join(self._args)
        if self._index is not None and not is_json_object(arguments):
            log(f"Warning: tool call {self._index} has incomplete or invalid JSON arguments")
        self._end_call(out, arguments)

    def _end_call(self, out: list[OutputEvent], arguments: str) -> None:
        if self._index is not None:
            out.append(ToolCallEnd(index=self._index, arguments=arguments))
        self._args = []
        self._index = None
        self._fresh = True
        self._after_call = True
        self._held_ws = ""

    # -- text

    def _emit_text(self, out: list[OutputEvent], text: str) -> None:
        # Whitespace at either end of a segment is held: it is dropped if a call follows.
        lead = self._fresh and self._after_call
        body, self._held_ws = hold_trailing_space(text, self._held_ws, drop_leading=lead)
        if body:
            self._fresh = False
            out.append(TextDelta(body))
