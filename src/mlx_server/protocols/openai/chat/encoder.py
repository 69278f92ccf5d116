"""Neutral events → OpenAI chat.completion JSON and chat.completion.chunk SSE frames; with
several choices (``n``), one single-choice ``ChatEncoder`` per choice, the usage summed."""

from __future__ import annotations

import time
from typing import Any

from mlx_server.engine.core.handle import Started
from mlx_server.events import (
    Finished,
    LogprobEntry,
    Logprobs,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from mlx_server.logs import log
from mlx_server.protocols.openai.errors import stream_error
from mlx_server.protocols.openai.finish import (
    DONE,
    KEEPALIVE,
    finish_reason,
    timings_json,
    total_usage,
    usage_json,
)
from mlx_server.server.sse import Frame, RawJSON, TextTemplate
from mlx_server.service.choices import counted_once


def logprob_json(e: LogprobEntry) -> dict[str, Any]:
    return {
        "token": e.token,
        "logprob": e.logprob,
        "bytes": e.bytes,
        "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in e.top],
    }


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
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
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
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage_json(fin.usage),
        }


class ChatEncoder:
    """The ``Encoder`` of one chat completion (choice ``index`` of it): chunks streamed, or
    the message collected."""

    keepalive = KEEPALIVE

    def __init__(
        self,
        request_id: str,
        model: str,
        include_usage: bool,
        want_logprobs: bool,
        index: int = 0,
    ):
        self.chunks = ChunkEncoder(request_id, model, index)
        self.builder: MessageBuilder | None = None  # while collecting
        self.include_usage = include_usage
        self.want_logprobs = want_logprobs
        self.fin: Finished | None = None

    def open(self, collect: bool) -> list[Frame]:
        self.builder = MessageBuilder() if collect else None
        return [Frame(self.chunks.role())]

    def start(self, index: int, started: Started) -> list[Frame]:
        return []

    def event(self, index: int, ev: Any) -> list[Frame]:
        if self.builder is not None:
            self.builder.add(ev)
            return []
        if isinstance(ev, TextDelta):  # the hot path
            return [Frame(self.chunks.content(ev.text))] if ev.text else []
        chunk = self.chunks.event(ev)
        return [Frame(chunk)] if chunk is not None else []

    def finish(self, index: int, fin: Finished) -> list[Frame]:
        self.fin = fin
        out = [Frame(self.chunks.final(fin, with_usage=not self.include_usage))]
        if self.include_usage:
            out.append(Frame(self.chunks.usage_chunk(fin)))
        return out

    def end(self) -> list[Frame]:
        return [DONE]

    def fail(self, message: str, fin: Finished | None) -> list[Frame]:
        return [Frame(stream_error(message))]

    def result(self) -> dict[str, Any]:
        assert self.fin is not None and self.builder is not None
        out = completion_json(self.chunks, self.builder, self.fin, self.want_logprobs)
        choice = out["choices"][0]
        msg = choice["message"]
        log(
            f"Response: {len(msg.get('content') or '')} chars, "
            f"{len(msg.get('tool_calls') or [])} tool call(s), finish={choice['finish_reason']}"
        )
        return out


class ChoicesEncoder:
    """The ``Encoder`` of a chat completion with ``n`` choices."""

    keepalive = KEEPALIVE

    def __init__(
        self, request_id: str, model: str, include_usage: bool, want_logprobs: bool, n: int
    ):
        self.encs = [ChatEncoder(request_id, model, False, want_logprobs, i) for i in range(n)]
        for e in self.encs:
            e.chunks.created = self.encs[0].chunks.created
        self.include_usage = include_usage
        self.finals: dict[int, Finished] = {}

    def _usage(self) -> dict[str, Any]:
        return usage_json(total_usage([self.finals[i] for i in sorted(self.finals)]))

    def open(self, collect: bool) -> list[Frame]:
        return [f for e in self.encs for f in e.open(collect)]

    def start(self, index: int, started: Started) -> list[Frame]:
        return []

    def event(self, index: int, ev: Any) -> list[Frame]:
        return self.encs[index].event(index, ev)

    def finish(self, index: int, fin: Finished) -> list[Frame]:
        fin = counted_once(fin, index, len(self.encs))
        self.finals[index] = fin
        enc = self.encs[index]
        enc.fin = fin
        chunk = enc.chunks.final(fin, with_usage=False)
        out = [Frame(chunk)]
        if len(self.finals) == len(self.encs):  # the summed usage rides on the last one
            if self.include_usage:
                usage = enc.chunks.usage_chunk(fin)
                usage["usage"] = self._usage()
                out.append(Frame(usage))
            else:
                chunk["usage"] = self._usage()
        return out

    def end(self) -> list[Frame]:
        return [DONE]

    def fail(self, message: str, fin: Finished | None) -> list[Frame]:
        return self.encs[0].fail(message, fin)

    def result(self) -> dict[str, Any]:
        out = self.encs[0].result()
        out["choices"] = [e.result()["choices"][0] for e in self.encs]
        out["usage"] = self._usage()
        out["timings"] = None  # per sequence; several ran
        log(f"Response: {len(self.encs)} choices")
        return out
