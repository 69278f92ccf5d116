"""FireFunction v2: `` functools[{"name": ..., "arguments": {...}}, ...]`` to the end."""

from __future__ import annotations

from typing import Any

from mlx_server.parsing.formats import json_calls

tool_call_start = "functools"
tool_call_end = ""

# Detection: a chat template holding every string of one of these groups writes this
# format; formats are tried by descending priority.
template_markers = (("functools[",),)
priority = 4


def parse_tool_call(text: str, tools: Any = None) -> list[dict[str, Any]]:
    return json_calls(text)
