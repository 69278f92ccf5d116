"""What the tool-call parsers (``tools.ToolCallParser``, Harmony's, functionary's) share:
their calls are numbered in order, each gets a fresh id (``new_call_id``), those beyond
``max_calls`` are dropped, and a parsed call is read the same way (``normalize_call``)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from mlx_server.events import OutputEvent, ToolCallStart
from mlx_server.parsing.json_scan import loads
from mlx_server.parsing.tags import SteppedDecoder
from mlx_server.parsing.tool_schema import tool_names


def new_call_id() -> str:
    """A fresh OpenAI-style call id: ``call_`` and 24 hex characters."""
    return "call_" + uuid.uuid4().hex[:24]


def normalize_call(item: object) -> tuple[str, str] | None:
    """``(name, arguments JSON object text)`` from one parsed call, or None if it is not one.

    Accepts ``{"name", "arguments"}`` (arguments as an object, a JSON string of one, or
    absent), ``"parameters"`` for ``"arguments"``, and the OpenAI ``{"function": {...}}``
    wrapper.
    """
    if not isinstance(item, dict):
        return None
    call: dict[str, Any] = item
    if "name" not in call and isinstance(call.get("function"), dict):
        call = call["function"]
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = call.get("arguments", call.get("parameters"))
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            args = loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False)


class CallDecoder(SteppedDecoder[OutputEvent]):
    """A ``SteppedDecoder`` of output that may hold tool calls."""

    def __init__(self, *, id_factory: Callable[[], str], max_calls: int | None) -> None:
        super().__init__()
        self._new_id = id_factory
        self._max_calls = max_calls
        self._count = 0  # calls emitted

    @property
    def saw_tool_calls(self) -> bool:
        """True once at least one call has been emitted."""
        return self._count > 0

    def _start_call(self, out: list[OutputEvent], name: str) -> int | None:
        """The next call's ``ToolCallStart`` and its index; None (and no event) for a call
        beyond ``max_calls``, which the parser then drops."""
        if self._max_calls is not None and self._count >= self._max_calls:
            return None
        index = self._count
        self._count += 1
        out.append(ToolCallStart(index=index, id=self._new_id(), name=name))
        return index


class MessageParser(CallDecoder):
    """A format that carries the answer, reasoning and tool calls as addressed messages
    (Harmony, functionary v3.2): the parser takes the whole output, and the pipeline builds
    it from the request's tools alone (None or empty: every call is text)."""

    def __init__(
        self,
        tools: list[dict[str, Any]] | None,
        *,
        id_factory: Callable[[], str],
        max_calls: int | None = None,
    ) -> None:
        super().__init__(id_factory=id_factory, max_calls=max_calls)
        self._names = tool_names(tools) if tools else set()
        self._begin()

    def _begin(self) -> None:
        """Set the format's own parsing state (called once, by ``__init__``)."""

    @property
    def in_reasoning(self) -> bool:
        """True while inside reasoning (after ``flush``: it was never ended)."""
        return False
