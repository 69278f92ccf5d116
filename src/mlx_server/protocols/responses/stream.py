"""Neutral events → the Responses API's output items, stream events and response object,
by ``ResponseEncoder``.

It serves both modes (``encoder.ResponseFrames``): a stream sends every event it returns; a
plain request keeps only the final response object. Output items appear in generation order: a
``reasoning`` item (the reasoning text as ``content``, as the spec allows for open models),
a ``message`` with one ``output_text`` part, ``function_call`` items.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from mlx_server.events import (
    Finished,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from mlx_server.protocols.responses.items import new_id

Event = dict[str, Any]


class ResponseEncoder:
    """Builds one response's stream events and its response object.

    ``base`` holds the request-derived fields of the response object (model, tools,
    tool_choice, instructions, sampling, ...); ``count_tokens`` measures the reasoning text
    for ``output_tokens_details.reasoning_tokens``.
    """

    def __init__(self, response_id: str, base: dict[str, Any], count_tokens: Callable[[str], int]):
        self.id = response_id
        self.base = base
        self.count_tokens = count_tokens
        self.created_at = int(time.time())
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being generated
        self.call_index: int | None = None  # the neutral index of the open function call
        self.status = "in_progress"
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.incomplete_reason: str | None = None
        self.completed_at: int | None = None
        self.reasoning_text: list[str] = []

    # ---- the response object -------------------------------------------------------------

    def response(self) -> dict[str, Any]:
        """The response object as it stands now."""
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "completed_at": self.completed_at,
            "error": self.error,
            "incomplete_details": (
                {"reason": self.incomplete_reason} if self.incomplete_reason else None
            ),
            **self.base,
            "output": [json.loads(json.dumps(item)) for item in self.output],
        }
        if self.usage is not None:  # known once the generation ends
            out["usage"] = self.usage
        return out

    def _event(self, kind: str, **fields: Any) -> Event:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def _lifecycle(self, kind: str) -> Event:
        return self._event(kind, response=self.response())

    # ---- events --------------------------------------------------------------------------

    def start(self) -> list[Event]:
        return [self._lifecycle("response.created"), self._lifecycle("response.in_progress")]

    def event(self, ev: Any) -> list[Event]:
        if isinstance(ev, ReasoningDelta) and ev.text:
            self.reasoning_text.append(ev.text)
            return self._text("reasoning", ev.text)
        if isinstance(ev, TextDelta) and ev.text:
            return self._text("message", ev.text)
        if isinstance(ev, ToolCallStart):
            events = self._close()
            item = {
                "id": new_id("fc"),
                "type": "function_call",
                "status": "in_progress",
                "call_id": ev.id,
                "name": ev.name,
                "arguments": "",
            }
            events += self._add(item)
            self.call_index = ev.index
            return events
        if isinstance(ev, ToolCallArgsDelta) and ev.text and self._is_call(ev.index):
            assert self.open is not None
            self.open["arguments"] += ev.text
            return [
                self._event("response.function_call_arguments.delta", **self._at(), delta=ev.text)
            ]
        if isinstance(ev, ToolCallEnd) and self._is_call(ev.index):
            assert self.open is not None
            self.open["arguments"] = ev.arguments
            return self._close()
        return []

    def finish(self, fin: Finished) -> list[Event]:
        """Close the open item and end the response: completed, incomplete, cancelled or failed."""
        # Only a token limit makes the response incomplete (the spec's one reason for it); a
        # model that stops inside its reasoning completes, its reasoning item incomplete.
        cut = fin.reason == "length"
        unfinished = cut or fin.reason == "cancelled" or fin.in_reasoning
        ended = "incomplete" if unfinished else "completed"
        events = self._close(ended)
        u = fin.usage
        reasoning = "".join(self.reasoning_text)
        reasoning_tokens = (
            min(self.count_tokens(reasoning), u.completion_tokens) if reasoning else 0
        )
        self.usage = {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": u.total_tokens,
        }
        if fin.reason == "error":
            self.status = "failed"
            self.error = {"code": "server_error", "message": fin.error or "generation failed"}
            return events + [self._lifecycle("response.failed")]
        if fin.reason == "cancelled":
            self.status = "cancelled"
            return events + [self._lifecycle("response.incomplete")]
        self.completed_at = int(time.time())
        if cut:
            self.status = "incomplete"
            self.incomplete_reason = "max_output_tokens"
            return events + [self._lifecycle("response.incomplete")]
        self.status = "completed"
        return events + [self._lifecycle("response.completed")]

    def abandon(self) -> None:
        """The client went away before the end: the response is cancelled where it stands."""
        if self.status == "in_progress":
            self._close("incomplete")
            self.status = "cancelled"

    def fail(self, message: str) -> list[Event]:
        """An internal fault mid-stream: the spec's ``error`` event, then ``response.failed``."""
        self.status = "failed"
        self.error = {"code": "server_error", "message": message}
        error = self._event("error", code="server_error", message=message, param=None)
        return [error, self._lifecycle("response.failed")]

    # ---- items ---------------------------------------------------------------------------

    def _is_open(self, kind: str) -> bool:
        return self.open is not None and self.open["type"] == kind

    def _is_call(self, index: int) -> bool:
        return self._is_open("function_call") and self.call_index == index

    def _at(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}

    def _add(self, item: dict[str, Any]) -> list[Event]:
        self.output.append(item)
        self.open = item
        added = self._event(
            "response.output_item.added",
            output_index=len(self.output) - 1,
            item=json.loads(json.dumps(item)),
        )
        return [added]

    def _text(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        if not self._is_open(kind):
            events += self._close()
            if kind == "message":
                item: dict[str, Any] = {
                    "id": new_id("msg"),
                    "type": "message",
                    "status": "in_progress",
                    "role": "assistant",
                    "content": [],
                }
                part: dict[str, Any] = {
                    "type": "output_text",
                    "text": "",
                    "annotations": [],
                    "logprobs": [],
                }
            else:
                item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": []}
                part = {"type": "reasoning_text", "text": ""}
            events += self._add(item)
            item["content"].append(part)
            events.append(
                self._event(
                    "response.content_part.added", **self._at(), content_index=0, part=dict(part)
                )
            )
        assert self.open is not None
        self.open["content"][0]["text"] += text
        if kind == "message":
            delta = self._event(
                "response.output_text.delta", **self._at(), content_index=0, delta=text, logprobs=[]
            )
        else:
            delta = self._event(
                "response.reasoning_text.delta", **self._at(), content_index=0, delta=text
            )
        return events + [delta]

    def _close(self, status: str = "completed") -> list[Event]:
        item = self.open
        if item is None:
            return []
        self.open = None
        at = {"item_id": item["id"], "output_index": len(self.output) - 1}
        events: list[Event] = []
        if item["type"] == "function_call":
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    **at,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        else:
            part = item["content"][0]
            if item["type"] == "message":
                done = self._event(
                    "response.output_text.done",
                    **at,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
            else:
                done = self._event(
                    "response.reasoning_text.done", **at, content_index=0, text=part["text"]
                )
            part_done = self._event(
                "response.content_part.done", **at, content_index=0, part=dict(part)
            )
            events += [done, part_done]
        item["status"] = status
        events.append(
            self._event(
                "response.output_item.done",
                output_index=at["output_index"],
                item=json.loads(json.dumps(item)),
            )
        )
        return events
