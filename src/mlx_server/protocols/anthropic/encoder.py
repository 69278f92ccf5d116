"""Neutral events → Anthropic Messages stream events and the whole ``message`` object.

``StreamEncoder`` turns events into the stream's event objects (``message_start``,
``content_block_*``, ``message_delta``, ``message_stop``). A non-streaming response is the
same events folded by ``MessageAccumulator``, so both forms always carry the same message.
Content blocks follow the order of the output: ``thinking``, ``text`` and ``tool_use``
blocks, a new block each time the kind changes.
"""

from __future__ import annotations

import copy
import hashlib
import json
import uuid
from typing import Any, Literal

from mlx_server.engine.core.handle import Started
from mlx_server.events import (
    Finished,
    FinishReason,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from mlx_server.logs import log
from mlx_server.protocols.anthropic.errors import error_json
from mlx_server.server.sse import Frame, RawJSON, TextTemplate

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
STOP_REASONS: dict[FinishReason, StopReason] = {
    "stop": "end_turn",
    "stop_sequence": "stop_sequence",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    # Cancelled through /v1/cancel while the client still listens: end the turn cleanly
    # with what was generated.
    "cancelled": "end_turn",
    "error": "end_turn",  # never sent: a failure ends the stream with an error event
}


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def tool_use_id(call_id: str) -> str:
    """Anthropic-style ``toolu_`` id for a neutral call id (``call_<hex>``)."""
    tail = call_id.removeprefix("call_")
    return "toolu_" + ("".join(c for c in tail if c.isalnum() or c in "_-") or uuid.uuid4().hex)


def thinking_signature(thinking: str) -> str:
    """An opaque signature for a thinking block (clients send it back; nothing checks it)."""
    return hashlib.sha256(thinking.encode()).hexdigest()


def stop_reason(fin: Finished) -> StopReason:
    return STOP_REASONS[fin.reason]


def usage_json(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """A full ``usage`` object. As in Anthropic's API, ``input_tokens`` excludes the prompt
    tokens read from the cache (``cache_read_input_tokens``); their sum is the prompt size."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
        "cache_creation": None,
        "inference_geo": None,
        "output_tokens_details": None,
        "server_tool_use": None,
        "service_tier": None,
    }


def delta_usage_json(u: Usage) -> dict[str, Any]:
    """The cumulative ``usage`` of ``message_delta`` (final counts, the cache split included)."""
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "output_tokens": u.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
        "output_tokens_details": None,
        "server_tool_use": None,
    }


def context_error_message(prompt_tokens: int, max_tokens: int, ctx_size: int) -> str:
    """Anthropic's wording for a request that does not fit the context. Clients act on it:
    Claude Code compacts the conversation on the first, and lowers max_tokens on the second."""
    if prompt_tokens >= ctx_size:
        return f"prompt is too long: {prompt_tokens} tokens > {ctx_size} maximum"
    return (
        f"input length and `max_tokens` exceed context limit: {prompt_tokens} + {max_tokens} "
        f"> {ctx_size}, decrease input length or `max_tokens` and try again"
    )


class StreamEncoder:
    """Builds the stream events of one response, tracking which content block is open."""

    def __init__(self, message_id: str, model: str, prompt_tokens: int):
        self.message_id = message_id
        self.model = model
        self.prompt_tokens = prompt_tokens
        self._index = -1  # index of the newest block
        self._open: str | None = None  # kind of the open block
        self._thinking: list[str] = []
        self._calls: dict[int, int] = {}  # call index → block index
        self._args: dict[int, str] = {}  # call index → arguments sent so far
        self._text: tuple[int, TextTemplate] | None = None  # the open text block's deltas

    def start(self, cached_tokens: int = 0) -> list[dict[str, Any]]:
        """``message_start`` (empty content, the prompt's token count, of which
        ``cached_tokens`` came from the prefix cache) and a ``ping``."""
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "stop_reason": None,
            "stop_sequence": None,
            "stop_details": None,
            "container": None,
            "usage": usage_json(self.prompt_tokens, 0, cached_tokens),
        }
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def event(self, ev: object) -> list[dict[str, Any]]:
        """The stream events for one neutral event (none for logprobs and empty pieces)."""
        if isinstance(ev, TextDelta) and ev.text:
            out = self._switch("text", {"type": "text", "text": "", "citations": None})
            return out + [self._delta({"type": "text_delta", "text": ev.text})]
        if isinstance(ev, ReasoningDelta) and ev.text:
            block = {"type": "thinking", "thinking": "", "signature": ""}
            out = self._switch("thinking", block)
            self._thinking.append(ev.text)
            return out + [self._delta({"type": "thinking_delta", "thinking": ev.text})]
        if isinstance(ev, ToolCallStart):
            return self._start_call(ev)
        if isinstance(ev, ToolCallArgsDelta) and ev.text and ev.index in self._calls:
            self._args[ev.index] += ev.text
            return [self._json_delta(ev.index, ev.text)]
        if isinstance(ev, ToolCallEnd) and ev.index in self._calls:
            return self._end_call(ev)
        return []

    def more_text(self, text: str) -> RawJSON | None:
        """The ``text_delta`` event of ``text`` as ``event`` serialises it, from a template per
        block, when a text block is open (most of a stream's events); else None."""
        if self._open != "text" or not text:
            return None
        if self._text is None or self._text[0] != self._index:
            delta = self._delta({"type": "text_delta", "text": TextTemplate.SLOT})
            self._text = self._index, TextTemplate(delta)
        return self._text[1].fill(text)

    def finish(self, fin: Finished) -> list[dict[str, Any]]:
        """Close the open block; ``message_delta`` (stop reason, usage) and ``message_stop``."""
        reason = stop_reason(fin)
        delta = {
            "stop_reason": reason,
            "stop_sequence": fin.stop_sequence if reason == "stop_sequence" else None,
            "stop_details": None,
            "container": None,
        }
        return self._close() + [
            {"type": "message_delta", "delta": delta, "usage": delta_usage_json(fin.usage)},
            {"type": "message_stop"},
        ]

    # ---- blocks ----------------------------------------------------------------------

    def _switch(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        """Continue the open block of this kind, or close the open one and start a new one."""
        return [] if self._open == kind else self._new_block(kind, block)

    def _new_block(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close()
        self._index += 1
        self._open = kind
        return out + [{"type": "content_block_start", "index": self._index, "content_block": block}]

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        out = []
        if self._open == "thinking":
            sig = thinking_signature("".join(self._thinking))
            self._thinking = []
            out.append(self._delta({"type": "signature_delta", "signature": sig}))
        self._open = None
        return out + [{"type": "content_block_stop", "index": self._index}]

    def _delta(self, delta: dict[str, Any], index: int | None = None) -> dict[str, Any]:
        i = self._index if index is None else index
        return {"type": "content_block_delta", "index": i, "delta": delta}

    def _json_delta(self, call: int, text: str) -> dict[str, Any]:
        delta = {"type": "input_json_delta", "partial_json": text}
        return self._delta(delta, self._calls[call])

    def _start_call(self, ev: ToolCallStart) -> list[dict[str, Any]]:
        block = {
            "type": "tool_use",
            "id": tool_use_id(ev.id),
            "name": ev.name,
            "input": {},
            "caller": {"type": "direct"},
        }
        out = self._new_block("tool_use", block)
        self._calls[ev.index] = self._index
        self._args[ev.index] = ""
        return out

    def _end_call(self, ev: ToolCallEnd) -> list[dict[str, Any]]:
        out = []
        sent = self._args[ev.index]
        # Formats parsed only at the call's end send their arguments here, in one piece.
        if ev.arguments.startswith(sent) and len(ev.arguments) > len(sent):
            out.append(self._json_delta(ev.index, ev.arguments[len(sent) :]))
            self._args[ev.index] = ev.arguments
        if self._open == "tool_use" and self._calls[ev.index] == self._index:
            out += self._close()
        return out


class MessageAccumulator:
    """Folds stream events into the final ``message`` object (the non-streaming body)."""

    def __init__(self) -> None:
        self.message: dict[str, Any] = {}
        self._json: dict[int, str] = {}

    def add(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "message_start":
            self.message = copy.deepcopy(event["message"])
        elif kind == "content_block_start":
            self.message["content"].append(copy.deepcopy(event["content_block"]))
        elif kind == "content_block_delta":
            self._delta(event["index"], event["delta"])
        elif kind == "content_block_stop":
            block = self.message["content"][event["index"]]
            if block["type"] == "tool_use":
                block["input"] = _parse_input(self._json.pop(event["index"], ""))
        elif kind == "message_delta":
            self.message.update({k: v for k, v in event["delta"].items() if k != "container"})
            self.message["usage"].update({k: v for k, v in event["usage"].items() if v is not None})

    def _delta(self, index: int, delta: dict[str, Any]) -> None:
        block = self.message["content"][index]
        kind = delta["type"]
        if kind == "text_delta":
            block["text"] += delta["text"]
        elif kind == "thinking_delta":
            block["thinking"] += delta["thinking"]
        elif kind == "signature_delta":
            block["signature"] = delta["signature"]
        elif kind == "input_json_delta":
            self._json[index] = self._json.get(index, "") + delta["partial_json"]


def _parse_input(text: str) -> dict[str, Any]:
    """A tool_use block's ``input`` object; ``{}`` when the arguments were cut short."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def frames(events: list[dict[str, Any]]) -> list[Frame]:
    return [Frame(e, event=e["type"]) for e in events]


PING = Frame({"type": "ping"}, event="ping")


class MessagesEncoder:
    """The ``Encoder`` of one Messages response: stream events, or folded into a whole
    message."""

    def __init__(self, enc: StreamEncoder):
        self.enc = enc
        self.acc: MessageAccumulator | None = None  # while collecting
        self.opened = False

    @property
    def keepalive(self) -> Frame:
        """Anthropic's own keep-alive, a ``ping`` event, once ``message_start`` went out
        (the first event of a stream); a comment line while the request still queues."""
        return PING if self.opened else Frame(comment="keep-alive")

    def _frames(self, events: list[dict[str, Any]]) -> list[Frame]:
        if self.acc is None:
            return frames(events)
        for e in events:
            self.acc.add(e)
        return []

    def open(self, collect: bool) -> list[Frame]:
        self.acc = MessageAccumulator() if collect else None
        return []

    def start(self, index: int, started: Started) -> list[Frame]:
        # message_start reports the prompt's cache split, known once the engine started it.
        self.opened = True
        return self._frames(self.enc.start(started.cached_tokens))

    def event(self, index: int, ev: Any) -> list[Frame]:
        if self.acc is None and type(ev) is TextDelta:  # the hot path: more of a text block
            data = self.enc.more_text(ev.text)
            if data is not None:
                return [Frame(data, event="content_block_delta")]
        return self._frames(self.enc.event(ev))

    def finish(self, index: int, fin: Finished) -> list[Frame]:
        # A request cancelled while it waited ends without a start: the message opens here.
        opening = [] if self.opened else self.start(index, Started(0))
        return opening + self._frames(self.enc.finish(fin))

    def end(self) -> list[Frame]:
        return []

    def fail(self, message: str, fin: Finished | None) -> list[Frame]:
        return frames([error_json("api_error", message)])

    def result(self) -> dict[str, Any]:
        assert self.acc is not None
        msg = self.acc.message
        kinds = ", ".join(b["type"] for b in msg["content"]) or "none"
        log(f"Response: blocks [{kinds}], stop_reason={msg['stop_reason']}")
        return msg
