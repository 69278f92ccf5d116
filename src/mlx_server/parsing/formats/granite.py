"""IBM Granite 3.x: ``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`` to the end."""

from __future__ import annotations

from typing import Any

from mlx_server.parsing.formats import json_calls

tool_call_start = "<|tool_call|>"
# The answer comes wrapped in these (Granite: when thinking).
content_markers = ("<response>", "</response>")
tool_call_end = ""

# Detection: a chat template holding every string of one of these groups writes this
# format; formats are tried by descending priority.
template_markers = (("<|tool_call|>",),)
priority = 5


def parse_tool_call(text: str, tools: Any = None) -> list[dict[str, Any]]:
    return json_calls(text)
