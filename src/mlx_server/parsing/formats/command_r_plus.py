"""Command R+: ``Action:`` then a fenced JSON list of ``{"tool_name", "parameters"}``."""

from __future__ import annotations

from typing import Any

from mlx_server.parsing.formats import json_calls

tool_call_start = "Action:"
tool_call_end = "```\n"


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
