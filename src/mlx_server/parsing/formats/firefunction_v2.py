"""FireFunction v2: `` functools[{"name": ..., "arguments": {...}}, ...]`` to the end."""

from __future__ import annotations

from typing import Any

from mlx_server.parsing.formats import json_calls

tool_call_start = "functools"
tool_call_end = ""


def parse_tool_call(text: str, tools: Any = None) -> list[dict[str, Any]]:
    return json_calls(text)
