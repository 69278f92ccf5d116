"""Phi-4-mini: ``<|tool_call|>{"name": ..., "arguments": {...}}<|/tool_call|>`` (or a list)."""

from __future__ import annotations

from typing import Any

from mlx_server.parsing.formats import json_calls

tool_call_start = "<|tool_call|>"
tool_call_end = "<|/tool_call|>"

# Detection: a chat template holding every string of one of these groups writes this
# format; formats are tried by descending priority.
template_markers = (("<|/tool_call|>",),)
priority = 6


def parse_tool_call(text: str, tools: Any = None) -> list[dict[str, Any]]:
    return json_calls(text)
