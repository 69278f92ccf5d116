"""Command R+: ``Action:`` then a fenced JSON list of ``{"tool_name", "parameters"}``."""

from __future__ import annotations

from typing import Any

from mlx_server.parsing.formats import json_calls

tool_call_start = "Action:"
tool_call_end = "```\n"

# Detection: a chat template holding every string of one of these groups writes this
# format; formats are tried by descending priority.
template_markers = ((r"Action:\n```json",),)  # as written in the Jinja string
priority = 2


def parse_tool_call(text: str, tools: Any = None) -> list[dict[str, Any]]:
    body = text.strip()
    if not body.startswith("```"):
        raise ValueError("not a Command R+ action")
    body = body[3:]
    if body.startswith("json"):
        body = body[4:]
    body = body.rstrip("`").strip()
    return [
        c for c in json_calls(body, "tool_name", "parameters") if c["name"] != "directly-answer"
    ]
