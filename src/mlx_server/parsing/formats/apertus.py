"""Apertus: ``<|tools_prefix|>[{"NAME": {...}}, ...]<|tools_suffix|>``."""

from __future__ import annotations

from typing import Any

from mlx_server.parsing.json_scan import loads

tool_call_start = "<|tools_prefix|>"
tool_call_end = "<|tools_suffix|>"

# Detection: a chat template holding every string of one of these groups writes this
# format; formats are tried by descending priority.
template_markers = (("<|tools_prefix|>",),)
priority = 3


def parse_tool_call(text: str, tools: Any = None) -> list[dict[str, Any]]:
    value = loads(text.strip())
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or len(item) != 1:
            raise ValueError("not an Apertus tool call")
        ((name, arguments),) = item.items()
        calls.append({"name": name, "arguments": arguments})
    if not calls:
        raise ValueError("no tool call")
    return calls
