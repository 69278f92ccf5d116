"""functionary v3.1 (Llama 3.1): ``<function=NAME>{...}</function>``, one call per block."""

from __future__ import annotations

from typing import Any

from mlx_server.parsing.json_scan import loads

tool_call_start = "<function="
tool_call_end = "</function>"

# Detection: a chat template holding every string of one of these groups writes this
# format; formats are tried by descending priority.
template_markers = (("start with <function= and end with </function>",),)
priority = 1


def parse_tool_call(text: str, tools: Any = None) -> dict[str, Any]:
    name, sep, arguments = text.partition(">")
    if not sep or not name.strip():
        raise ValueError("not a functionary tool call")
    return {"name": name.strip(), "arguments": loads(arguments) if arguments.strip() else {}}
