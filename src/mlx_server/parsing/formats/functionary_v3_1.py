"""functionary v3.1 (Llama 3.1): ``<function=NAME>{...}</function>``, one call per block."""

from __future__ import annotations

import json
from typing import Any

tool_call_start = "<function="
tool_call_end = "</function>"


def parse_tool_call(text: str, tools: Any = None) -> dict[str, Any]:
    name, sep, arguments = text.partition(">")
    if not sep or not name.strip():
        raise ValueError("not a functionary tool call")
    return {"name": name.strip(), "arguments": json.loads(arguments) if arguments.strip() else {}}
