"""Incremental parsing of gpt-oss output in OpenAI's Harmony format.

After the prompt's ``<|start|>assistant`` the model writes messages such as::

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

- ``analysis`` is reasoning (``ReasoningDelta``);
- ``final`` is the answer (``TextDelta``), as is ``commentary`` addressed to no one (a preamble
  the user may see);
- a message addressed ``to=functions.NAME`` (in the header before or after the channel) is a
  tool call: ``ToolCallStart`` when its header is complete, its body streamed as
  ``ToolCallArgsDelta``, ``ToolCallEnd`` at ``<|call|>`` (or wherever the message ends).
  A call to a function the request did not offer, or when no tools were offered, is text.

``<|return|>`` and ``<|call|>`` end generation (the engine usually stops on them, so they may
never arrive); ``<|end|>`` ends one message and another follows. Output that does not start
like a Harmony header is the answer, so a model that skips the format loses nothing. The
parser holds back only what could still be the start of a control token.

``openai-harmony`` (PyPI) does this on token ids, but loads its vocabulary from the internet
and works with gpt-oss's own tokenizer only; this parser reads the decoded text.
"""

from __future__ import annotations

import re

from mlx_server.events import (
    OutputEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
)
from mlx_server.parsing.call_decoder import MessageParser

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
END = "<|end|>"
RETURN = "<|return|>"
CALL = "<|call|>"
CONSTRAIN = "<|constrain|>"
_TERMINATORS = [END, RETURN, CALL, START]
# How a header may begin; anything else at a message start is plain answer text.
_HEADER_OPENERS = (START, CHANNEL, "to=", "assistant", " to=")
_MAX_HEADER = 256  # a "header" longer than this without <|message|> is text

_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")

_HEADER = "header"
_BODY = "body"

# Detection: a template that writes channels and messages, over a vocabulary (where known)
# with the channel token.
template_markers = ((CHANNEL, MESSAGE),)
vocab_markers = (CHANNEL,)


class HarmonyParser(MessageParser):
    """Incremental decoder of Harmony output into reasoning, text and tool-call events."""

    def _begin(self) -> None:
        self._state = _HEADER
        self._channel = "final"
        self._call: int | None = None  # index of the call being streamed
        self._dropped = False  # the current message is a call beyond max_calls
        self._args: list[str] = []
        self._raw_header = ""  # the header, for writing an unknown call back as text
        self._recipient: str | None = None

    @property
    def in_reasoning(self) -> bool:
        """True while inside an analysis message (after ``flush``: it was never ended)."""
        return self._state == _BODY and self._channel == "analysis"

    def flush(self) -> list[OutputEvent]:
        out: list[OutputEvent] = []
        buf, self._buf = self._buf, ""
        if self._state == _HEADER:
            if buf.strip() and not _is_control_only(buf):
                self._emit(out, "final", buf)
        else:
            self._emit_body(out, buf)
            self._end_message(out)
            self._state = _BODY  # in_reasoning reports an unterminated analysis
        return out

    # -- states

    def _step(self, out: list[OutputEvent]) -> bool:
        if self._state == _HEADER:
            return self._step_header(out)
        return self._step_body(out)

    def _step_header(self, out: list[OutputEvent]) -> bool:
        pos = self._buf.find(MESSAGE)
        if pos < 0:
            rest = self._buf.lstrip()
            if not rest:
                return False
            if len(self._buf) > _MAX_HEADER or not _may_open_header(rest):
                self._open("final", None, "")  # not Harmony: plain answer text
                return True
            return False
        header, self._buf = self._buf[:pos], self._buf[pos + len(MESSAGE) :]
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        self._open(
            channel.group(1) if channel else "final",
            recipient.group(1) if recipient else None,
            header + MESSAGE,
        )
        self._begin_call(out)
        return True

    def _step_body(self, out: list[OutputEvent]) -> bool:
        text, tag = self._take_until(_TERMINATORS)
        self._emit_body(out, text)
        if tag is None:
            return False
        if tag != START:  # a new message's start stays: it opens the next header
            self._buf = self._buf[len(tag) :]
        self._end_message(out)
        self._state = _HEADER
        return True

    # -- messages

    def _open(self, channel: str, recipient: str | None, raw_header: str) -> None:
        self._state = _BODY
        self._channel = channel
        self._recipient = recipient
        self._raw_header = raw_header
        self._call = None
        self._dropped = False
        self._args = []

    def _begin_call(self, out: list[OutputEvent]) -> None:
        name = _function_name(self._recipient)
        if name is None or name not in self._names:
            return
        self._call = self._start_call(out, name)
        self._dropped = self._call is None

    def _emit_body(self, out: list[OutputEvent], text: str) -> None:
        if not text:
            return
        if self._call is not None:
            self._args.append(text)
            out.append(ToolCallArgsDelta(index=self._call, text=text))
        elif self._dropped:
            return
        elif self._recipient is not None and _function_name(self._recipient) is not None:
            # A call to a function that was not offered: kept, as the text the model wrote.
            if self._raw_header:
                out.append(TextDelta(self._raw_header))
                self._raw_header = ""
            out.append(TextDelta(text))
        else:
            self._emit(out, self._channel, text)

    def _end_message(self, out: list[OutputEvent]) -> None:
        if self._call is not None:
            out.append(ToolCallEnd(index=self._call, arguments="".join(self._args)))
            self._call = None
        self._args = []

    @staticmethod
    def _emit(out: list[OutputEvent], channel: str, text: str) -> None:
        out.append(ReasoningDelta(text) if channel == "analysis" else TextDelta(text))


def _function_name(recipient: str | None) -> str | None:
    if recipient and recipient.startswith("functions.") and len(recipient) > len("functions."):
        return recipient[len("functions.") :]
    return None


def _may_open_header(text: str) -> bool:
    return any(o.startswith(text[: len(o)]) or text.startswith(o) for o in _HEADER_OPENERS)


def _is_control_only(text: str) -> bool:
    return not re.sub(r"<\|[a-z_]+\|>|assistant|\s", "", text)


message_parser = HarmonyParser
