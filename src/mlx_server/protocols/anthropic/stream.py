"""Neutral events → the Anthropic Messages stream's event objects (``message_start``,
``content_block_*``, ``message_delta``, ``message_stop``), by ``StreamEncoder``. Content
blocks follow the order of the output: ``thinking``, ``text`` and ``tool_use`` blocks, a new
block each time the kind changes."""

from __future__ import annotations

import hashlib
import uuid
from typing import Any, Literal

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
from mlx_server.server.sse import RawJSON, TextTemplate

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
