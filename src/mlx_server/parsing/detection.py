"""Which output format a model writes, decided once per model, in one place.

A model writes either addressed messages (Harmony, functionary v3.2: one decoder for the
answer, reasoning and tool calls) or tagged text with a tool-call format. Both come from
the format registry (``parsing.formats``), each format declaring its own markers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_server.parsing.call_decoder import MessageParser
from mlx_server.parsing.formats import registered
from mlx_server.parsing.tool_formats import AUTO, ToolFormat, resolve_tool_parser, tool_format

# The format assumed when none is detected: Hermes-style <tool_call> JSON, the most common
# one, which the prompt builder also describes to templates that don't render tools.
FALLBACK_TOOL_FORMAT = "json_tools"


@dataclass(frozen=True)
class OutputFormat:
    """How a model's output is parsed: ``messages`` names a message format, else
    ``tools`` is its tool-call format (None: tool calls are not parsed)."""

    tools: ToolFormat | None
    messages: str | None = None


def detect_output_format(
    tokenizer: Any, template: str, vocab: Any, tool_call_parser: str | None = None
) -> OutputFormat:
    """``tool_call_parser``: ``--tool-call-parser`` (a name, ``"none"``, or None/``"auto"``
    to detect). A message format is found from the template; an explicit parser is kept
    beside it, a detected one is not (the messages carry the calls)."""
    auto = tool_call_parser in (None, AUTO)
    messages = message_format(template, vocab)
    if messages is not None and auto:
        return OutputFormat(None, messages)
    tools = resolve_tool_parser(tool_call_parser, tokenizer)
    if tools is None and auto:
        tools = tool_format(FALLBACK_TOOL_FORMAT)
    return OutputFormat(tools, messages)


def message_format(template: str, vocab: Any) -> str | None:
    for r in registered():
        if r.writes_messages and r.matches(template, vocab):
            return r.name
    return None


def message_parser(name: str) -> type[MessageParser]:
    """The decoder class of a message format."""
    for r in registered():
        if r.name == name and r.writes_messages:
            parser: type[MessageParser] = r.module.message_parser
            return parser
    raise ValueError(f"unknown message format {name!r}")


def message_formats() -> list[str]:
    return [r.name for r in registered() if r.writes_messages]
