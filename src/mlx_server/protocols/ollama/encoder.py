"""Neutral events → Ollama's NDJSON chunks and its final ``done`` object.

Each piece of the answer is a chunk ``{"model", "created_at", <piece>, "done": false}``
where the piece is ``message`` (``/api/chat``: ``content``, ``thinking``, ``tool_calls``)
or ``response`` / ``thinking`` (``/api/generate``). Tool calls go out whole, once parsed,
as Ollama sends them. The last chunk has ``done: true``, ``done_reason`` and the counters
(durations in nanoseconds). A collected answer is the same chunks folded into one object.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

from mlx_server.engine.core.handle import Started
from mlx_server.events import (
    Finished,
    FinishReason,
    LogprobEntry,
    Logprobs,
    ReasoningDelta,
    TextDelta,
    ToolCallEnd,
    ToolCallStart,
)
from mlx_server.logs import log
from mlx_server.parsing.json_scan import loads
from mlx_server.server.sse import Frame

DONE_REASONS: dict[FinishReason, str] = {
    "stop": "stop",
    "stop_sequence": "stop",
    "tool_calls": "stop",
    "length": "length",
    "cancelled": "stop",  # /v1/cancel while the client listens: the answer so far
    "error": "stop",  # never sent: a failure ends the stream with an error line
}


def created_at() -> str:
    """RFC 3339 in UTC, as Ollama writes it."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def logprob_json(entry: LogprobEntry) -> dict[str, Any]:
    """Ollama's ``{"token", "logprob", "bytes", "top_logprobs"}``."""
    out: dict[str, Any] = {"token": entry.token, "logprob": entry.logprob}
    if entry.bytes is not None:
        out["bytes"] = entry.bytes
    if entry.top:
        out["top_logprobs"] = [
            {"token": t.token, "logprob": t.logprob, **({"bytes": t.bytes} if t.bytes else {})}
            for t in entry.top
        ]
    return out


def tool_call_json(name: str, arguments: str, index: int) -> dict[str, Any]:
    """Ollama's tool call: ``arguments`` is an object, not JSON text."""
    try:
        args = loads(arguments) if arguments.strip() else {}
    except ValueError:
        args = {}  # cut short (max tokens): no arguments rather than broken ones
    return {"function": {"index": index, "name": name, "arguments": args}}


class Clock:
    """The request's times in nanoseconds: arrival, body read (model leased or loaded),
    generation started, first piece, end."""

    def __init__(self, arrived_ns: int):
        self.arrived = arrived_ns
        self.loaded = self.started = self.first = time.perf_counter_ns()

    def mark_started(self) -> None:
        self.started = self.first = time.perf_counter_ns()

    def mark_piece(self) -> None:
        if self.first == self.started:
            self.first = time.perf_counter_ns()

    def counters(self, fin: Finished) -> dict[str, int]:
        now = time.perf_counter_ns()
        t = fin.timings
        prompt_ns = int(t.prompt_ms * 1e6) if t else self.first - self.started
        eval_ns = int(t.predicted_ms * 1e6) if t else now - self.first
        load_ns = self.loaded - self.arrived
        prompt_ns, eval_ns = max(0, prompt_ns), max(0, eval_ns)
        # The engine times its parts on its own thread; the total is never less than them.
        total_ns = max(now - self.arrived, load_ns + prompt_ns + eval_ns)
        return {
            "total_duration": total_ns,
            "load_duration": load_ns,
            "prompt_eval_count": fin.usage.prompt_tokens,
            "prompt_eval_duration": prompt_ns,
            "eval_count": fin.usage.completion_tokens,
            "eval_duration": eval_ns,
        }


class OllamaEncoder:
    """The stream driver's ``Encoder`` for one ``/api/chat`` (``chat=True``) or
    ``/api/generate`` response."""

    def __init__(self, model: str, clock: Clock, *, chat: bool):
        self.model = model
        self.clock = clock
        self.chat = chat
        self.content: list[str] = []
        self.thinking: list[str] = []
        self.tool_calls: list[dict[str, Any]] = []
        self._names: dict[int, str] = {}
        self.final: dict[str, Any] = {}
        # Log-probabilities ride on the next piece sent (or the last chunk).
        self._pending: list[dict[str, Any]] = []
        self.logprobs: list[dict[str, Any]] = []
        self.collect = False  # the pieces are kept for one object, not sent

    @property
    def keepalive(self) -> Frame:
        """An empty piece: valid for every Ollama client, and bytes on a quiet line."""
        return Frame(self._chunk(""))

    def _chunk(self, text: str, thinking: str | None = None, calls: Any = None) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": created_at()}
        self._put_output(out, text, thinking, calls)
        if self._pending:
            out["logprobs"] = self._pending
            self._pending = []
        out["done"] = False
        return out

    def _put_output(self, out: dict[str, Any], text: str, thinking: str | None, calls: Any) -> None:
        """The output's fields: /api/chat's ``message``, /api/generate's ``response`` (and
        ``thinking`` beside either)."""
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking is not None:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            out["message"] = message
        else:
            out["response"] = text
            if thinking is not None:
                out["thinking"] = thinking

    def open(self, collect: bool) -> list[Frame]:
        self.collect = collect
        return []

    def start(self, index: int, started: Started) -> list[Frame]:
        self.clock.mark_started()
        return []

    def event(self, index: int, ev: Any) -> list[Frame]:
        if isinstance(ev, Logprobs):
            entries = [logprob_json(e) for e in ev.entries]
            (self.logprobs if self.collect else self._pending).extend(entries)
            return []
        if isinstance(ev, TextDelta) and ev.text:
            self.clock.mark_piece()
            return self._piece(self.content, ev.text, ev.text)
        if isinstance(ev, ReasoningDelta) and ev.text:
            self.clock.mark_piece()
            return self._piece(self.thinking, ev.text, "", thinking=ev.text)
        if isinstance(ev, ToolCallStart):
            self._names[ev.index] = ev.name
            return []
        if isinstance(ev, ToolCallEnd) and self.chat:
            call = tool_call_json(self._names.get(ev.index, ""), ev.arguments, ev.index)
            return self._piece(self.tool_calls, call, "", calls=[call])
        return []

    def _piece(self, kept: list[Any], value: Any, text: str, **chunk: Any) -> list[Frame]:
        """A stream's chunk for one piece, or the piece kept for a collected answer."""
        if self.collect:
            kept.append(value)
            return []
        return [Frame(self._chunk(text, **chunk))]

    def finish(self, index: int, fin: Finished) -> list[Frame]:
        return [Frame(self.done(DONE_REASONS[fin.reason], self.clock.counters(fin)))]

    def done(self, reason: str, counters: dict[str, int] | None = None) -> dict[str, Any]:
        """The last chunk (kept for a collected answer)."""
        out = self._chunk("")
        out.update(done=True, done_reason=reason, **(counters or {}))
        self.final = out
        return out

    def end(self) -> list[Frame]:
        return []

    def fail(self, message: str, fin: Finished | None) -> list[Frame]:
        return []  # the driver's error frame is Ollama's {"error": ...} line

    def result(self) -> dict[str, Any]:
        out = dict(self.final)
        text = "".join(self.content)
        thinking = "".join(self.thinking) or None
        self._put_output(out, text, thinking, self.tool_calls)
        if self.logprobs:
            out["logprobs"] = self.logprobs
        log(f"Response: {len(text)} chars, {len(self.tool_calls)} tool call(s)")
        return out
