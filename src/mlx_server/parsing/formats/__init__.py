"""Tool-call formats mlx-lm's ``tool_parsers`` lacks, in the same module shape: a
``tool_call_start`` marker, a ``tool_call_end`` marker (empty: the call runs to the end of
the output) and ``parse_tool_call(text, tools)`` for the text between them, returning
``{"name", "arguments"}`` or a list of them (``tool_formats`` registers and detects them)."""

from __future__ import annotations

import json
from typing import Any


def json_calls(text: str, name_key: str = "name", args_key: str = "arguments") -> list[dict]:
    """A JSON list (or one object) of calls, with their name and arguments under the given
    keys, as ``{"name", "arguments"}`` dicts. Raises ValueError when it is not one."""
    value: Any = json.loads(text.strip())
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get(name_key), str):
            raise ValueError("not a tool call")
        args = item.get(args_key, item.get("parameters", {}))
        calls.append({"name": item[name_key], "arguments": args if args is not None else {}})
    if not calls:
        raise ValueError("no tool call")
    return calls
