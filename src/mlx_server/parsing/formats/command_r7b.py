"""Command R7B: ``<|START_ACTION|>[{"tool_call_id": "0", "tool_name": ..., "parameters": {...}}]<|END_ACTION|>``."""

from __future__ import annotations

from typing import Any

from mlx_server.parsing.formats import json_calls

tool_call_start = "<|START_ACTION|>"
# The answer comes wrapped in these (Granite: when thinking).
content_markers = ("<|START_RESPONSE|>", "<|END_RESPONSE|>")
tool_call_end = "<|END_ACTION|>"

# Detection: a chat template holding every string of one of these groups writes this
# format; formats are tried by descending priority.
template_markers = (("<|START_ACTION|>",),)
priority = 9


def parse_tool_call(text: str, tools: Any = None) -> list[dict[str, Any]]:
    return json_calls(text, name_key="tool_name", args_key="parameters")
