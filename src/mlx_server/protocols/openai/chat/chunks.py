"""Neutral events → OpenAI ``chat.completion.chunk`` objects, the frames of a streamed chat
completion (one choice's)."""

from __future__ import annotations

import time
from typing import Any

from mlx_server.events import (
    Finished,
    LogprobEntry,
    Logprobs,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallStart,
)
from mlx_server.protocols.openai.finish import finish_reason, timings_json, usage_json
from mlx_server.server.sse import RawJSON, TextTemplate


def logprob_json(e: LogprobEntry) -> dict[str, Any]:
    return {
        "token": e.token,
        "logprob": e.logprob,
        "bytes": e.bytes,
        "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in e.top],
    }


class ChunkEncoder:
    """Builds chat.completion.chunk frames for one streamed response."""

    def __init__(self, request_id: str, model: str, index: int = 0):
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.index = index  # the choice's
        self._content: TextTemplate | None = None  # the content chunk's

    def _chunk(
        self, delta: dict[str, Any], finish: str | None = None, **extra: Any
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": self.index, "delta": delta, "finish_reason": finish}
        choice.update(extra)
        return self._object([choice])

    def _object(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def content(self, text: str) -> RawJSON:
        """The chunk of a piece of content, as ``_chunk({"content": text})`` serialises,
        from a template made on first use (most of a stream's chunks are these)."""
        if self._content is None:
            self._content = TextTemplate(self._chunk({"content": TextTemplate.SLOT}))
        return self._content.fill(text)

    def role(self) -> dict[str, Any]:
        return self._chunk({"role": "assistant", "content": ""})

    def event(self, ev: Any) -> dict[str, Any] | None:
        if isinstance(ev, TextDelta):
            return self._chunk({"content": ev.text}) if ev.text else None
        if isinstance(ev, ReasoningDelta):
            return self._chunk({"reasoning_content": ev.text}) if ev.text else None
        if isinstance(ev, ToolCallStart):
            call = {
                "index": ev.index,
                "id": ev.id,
                "type": "function",
                "function": {"name": ev.name, "arguments": ""},
            }
            return self._chunk({"tool_calls": [call]})
        if isinstance(ev, ToolCallArgsDelta):
            return (
                self._chunk(
                    {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]}
                )
                if ev.text
                else None
            )
        if isinstance(ev, Logprobs):
            lp = {"content": [logprob_json(e) for e in ev.entries], "refusal": None}
            return self._chunk({}, logprobs=lp)
        return None  # ToolCallEnd: the arguments were already streamed

    def final(self, fin: Finished, *, with_usage: bool = True) -> dict[str, Any]:
        """The chunk with ``finish_reason``. Usage rides on it (as Jan's clients expect)
        unless the spec's own usage chunk follows (``stream_options.include_usage``)."""
        chunk = self._chunk({}, finish_reason(fin))
        if with_usage:
            chunk["usage"] = usage_json(fin.usage)
        if fin.timings:
            chunk["timings"] = timings_json(fin.timings)
        return chunk

    def usage_chunk(self, fin: Finished) -> dict[str, Any]:
        return {**self._object([]), "usage": usage_json(fin.usage)}
