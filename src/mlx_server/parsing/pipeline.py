"""The output parsers composed: reasoning split, then tool calls in the answer text.

Tool calls are looked for in content only: markup inside a reasoning block stays reasoning.
Conversely, think tags written inside a tool call's markup stay part of the call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from mlx_server.events import (
    OutputEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from mlx_server.parsing.call_decoder import MessageParser, new_call_id
from mlx_server.parsing.detection import message_parser
from mlx_server.parsing.reasoning import ReasoningSplitter
from mlx_server.parsing.tags import MarkerStripper
from mlx_server.parsing.tool_formats import ToolFormat
from mlx_server.parsing.tools import ToolCallParser


class OutputPipeline:
    """Incremental decoder of generated text into neutral output events."""

    def __init__(
        self,
        *,
        reasoning: tuple[str, str] | None,
        start_in_reasoning: bool,
        tool_format: ToolFormat | None,
        tools: list[dict[str, Any]] | None,
        max_calls: int | None = None,
        id_factory: Callable[[], str] = new_call_id,
        message_format: str | None = None,
        content_markers: tuple[str, ...] = (),
    ) -> None:
        """
        ``reasoning``: the think tags, or None to pass reasoning through as text (for
        ``reasoning_format: none`` or a model without them). ``start_in_reasoning``: the
        prompt already opened a block (see ``prompt_opens_reasoning``). Tool calls are
        parsed only when both ``tool_format`` and a non-empty ``tools`` are given;
        ``max_calls=1`` implements ``parallel_tool_calls: false``. ``message_format``:
        ``"harmony"`` (gpt-oss) or ``"functionary_v3_2"``, formats that carry the answer,
        reasoning and tool calls as addressed messages (``tools`` alone then says which calls
        to parse; ``tool_format`` and ``reasoning`` are not used). ``content_markers``:
        literal wrappers removed from the answer text (``<|START_RESPONSE|>``).
        """
        self._stripper = MarkerStripper(content_markers) if content_markers else None
        self._harmony: MessageParser | None = None  # a message format's parser
        if message_format is not None:
            parser = message_parser(message_format)
            self._harmony = parser(tools, id_factory=id_factory, max_calls=max_calls)
        self._tools = (
            ToolCallParser(tool_format, tools, id_factory=id_factory, max_calls=max_calls)
            if tool_format is not None and tools
            else None
        )
        verbatim = [(tool_format.start, tool_format.end)] if self._tools and tool_format else []
        self._splitter = (
            ReasoningSplitter(
                reasoning[0],
                reasoning[1],
                start_in_reasoning=start_in_reasoning,
                verbatim=verbatim,
            )
            if reasoning is not None
            else None
        )

    @property
    def in_reasoning(self) -> bool:
        """True while inside a reasoning block (after ``flush``: it was never closed)."""
        if self._harmony is not None:
            return self._harmony.in_reasoning
        return self._splitter is not None and self._splitter.in_reasoning

    @property
    def saw_tool_calls(self) -> bool:
        """True once a tool call has been emitted."""
        if self._harmony is not None:
            return self._harmony.saw_tool_calls
        return self._tools is not None and self._tools.saw_tool_calls

    def feed(self, text: str) -> list[OutputEvent]:
        """Consume a piece of generated text; return the events that are now certain."""
        if self._harmony is not None:
            return merge_events(self._harmony.feed(text))
        if self._splitter is None:
            split: list[TextDelta | ReasoningDelta] = [TextDelta(text)] if text else []
        else:
            split = self._splitter.feed(text)
        if len(split) == 1 and self._tools is None and self._stripper is None:
            return [split[0]] if split[0].text else []  # a token's usual piece: nothing to merge
        return merge_events(self._strip(self._route(split)))

    def flush(self) -> list[OutputEvent]:
        """End of generation: everything still held back, as final events."""
        if self._harmony is not None:
            return merge_events(self._harmony.flush())
        events = self._route(self._splitter.flush() if self._splitter else [])
        if self._tools is not None:
            events.extend(self._tools.flush())
        events = self._strip(events)
        if self._stripper is not None:
            events.append(TextDelta(self._stripper.flush()))
        return merge_events(events)

    def _strip(self, events: list[OutputEvent]) -> list[OutputEvent]:
        if self._stripper is None:
            return events
        out: list[OutputEvent] = []
        for event in events:
            if isinstance(event, TextDelta):
                out.append(TextDelta(self._stripper.feed(event.text)))
            else:  # a held partial marker did not continue: it is text
                out.append(TextDelta(self._stripper.flush()))
                out.append(event)
        return out

    def _route(self, events: Iterable[TextDelta | ReasoningDelta]) -> list[OutputEvent]:
        out: list[OutputEvent] = []
        for event in events:
            if self._tools is None:
                out.append(event)
            elif isinstance(event, TextDelta):
                out.extend(self._tools.feed(event.text))
            else:
                out.extend(self._tools.interrupt())
                out.append(event)
        return out


def merge_events(events: Iterable[OutputEvent]) -> list[OutputEvent]:
    """Join adjacent text, reasoning, and same-call argument pieces; drop empty pieces."""
    out: list[OutputEvent] = []
    for event in events:
        if isinstance(event, (TextDelta, ReasoningDelta, ToolCallArgsDelta)) and not event.text:
            continue
        last = out[-1] if out else None
        if isinstance(event, TextDelta) and isinstance(last, TextDelta):
            out[-1] = TextDelta(last.text + event.text)
        elif isinstance(event, ReasoningDelta) and isinstance(last, ReasoningDelta):
            out[-1] = ReasoningDelta(last.text + event.text)
        elif (
            isinstance(event, ToolCallArgsDelta)
            and isinstance(last, ToolCallArgsDelta)
            and last.index == event.index
        ):
            out[-1] = ToolCallArgsDelta(index=event.index, text=last.text + event.text)
        else:
            out.append(event)
    return out


def collect(events: Iterable[OutputEvent]) -> dict[str, Any]:
    """Assemble a whole message from events (for non-streaming responses).

    Returns ``{"content": str | None, "reasoning_content": str | None,
    "tool_calls": [{"id", "name", "arguments"}]}``; empty text becomes None.
    """
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for event in events:
        if isinstance(event, TextDelta):
            content.append(event.text)
        elif isinstance(event, ReasoningDelta):
            reasoning.append(event.text)
        elif isinstance(event, ToolCallStart):
            calls[event.index] = {"id": event.id, "name": event.name, "arguments": "", "_parts": []}
        elif isinstance(event, ToolCallArgsDelta) and event.index in calls:
            calls[event.index]["_parts"].append(event.text)
        elif isinstance(event, ToolCallEnd) and event.index in calls:
            calls[event.index]["arguments"] = event.arguments
            calls[event.index]["_done"] = True
    tool_calls = []
    for index in sorted(calls):
        call = calls[index]
        arguments = call["arguments"] if call.get("_done") else "".join(call["_parts"])
        tool_calls.append({"id": call["id"], "name": call["name"], "arguments": arguments})
    return {
        "content": "".join(content) or None,
        "reasoning_content": "".join(reasoning) or None,
        "tool_calls": tool_calls,
    }
