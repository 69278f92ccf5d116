"""The ``Encoder`` of a chat completion: ``chat.completion.chunk`` frames streamed
(``chunks.py``), or the whole ``chat.completion`` collected (``message.py``); with several
choices (``n``), one single-choice ``ChatEncoder`` per choice, the usage summed."""

from __future__ import annotations

from typing import Any

from mlx_server.engine.core.handle import Started
from mlx_server.events import Finished, TextDelta
from mlx_server.logs import log
from mlx_server.protocols.openai.chat.chunks import ChunkEncoder
from mlx_server.protocols.openai.chat.message import MessageBuilder, completion_json
from mlx_server.protocols.openai.errors import stream_error
from mlx_server.protocols.openai.finish import DONE, KEEPALIVE, total_usage, usage_json
from mlx_server.server.sse import Frame
from mlx_server.service.choices import counted_once


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
