"""Neutral events → the whole ``chat.completion`` object of a chat completion not streamed."""

from __future__ import annotations

from typing import Any

from mlx_server.events import (
    Finished,
    Logprobs,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from mlx_server.protocols.openai.chat.chunks import ChunkEncoder, logprob_json
from mlx_server.protocols.openai.finish import finish_reason, timings_json, usage_json


class MessageBuilder:
    """Assembles a whole assistant message from events (non-streaming responses)."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.logprobs: list[dict[str, Any]] = []

    def add(self, ev: Any) -> None:
        if isinstance(ev, TextDelta):
            self.content.append(ev.text)
        elif isinstance(ev, ReasoningDelta):
            self.reasoning.append(ev.text)
        elif isinstance(ev, ToolCallStart):
            self.calls[ev.index] = {
                "id": ev.id,
                "type": "function",
                "function": {"name": ev.name, "arguments": ""},
            }
        elif isinstance(ev, ToolCallArgsDelta):
            self.calls[ev.index]["function"]["arguments"] += ev.text
        elif isinstance(ev, ToolCallEnd):
            self.calls[ev.index]["function"]["arguments"] = ev.arguments
        elif isinstance(ev, Logprobs):
            self.logprobs.extend(logprob_json(e) for e in ev.entries)

    def message(self) -> dict[str, Any]:
        text = "".join(self.content)
        msg: dict[str, Any] = {
            "role": "assistant",
            "content": text if (text or not self.calls) else None,
            "refusal": None,
        }
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            msg["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        return msg


def completion_json(
    chunks: ChunkEncoder, builder: MessageBuilder, fin: Finished, want_logprobs: bool
) -> dict[str, Any]:
    return {
        "id": chunks.id,
        "object": "chat.completion",
        "created": chunks.created,
        "model": chunks.model,
        "choices": [
            {
                "index": chunks.index,
                "message": builder.message(),
                "finish_reason": finish_reason(fin),
                "logprobs": {"content": builder.logprobs, "refusal": None}
                if want_logprobs
                else None,
            }
        ],
        "usage": usage_json(fin.usage),
        "timings": timings_json(fin.timings) if fin.timings else None,
    }
