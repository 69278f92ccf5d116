"""The Llama 3.1 / 3.2 JSON tool-call format, which mlx-lm has no parser for.

The template asks for ``{"name": function name, "parameters": {...}}`` as the whole answer;
the model writes it bare or after ``<|python_tag|>``, sometimes several separated by ``;``.
Same module shape as ``mlx_lm.tool_parsers``: markers and ``parse_tool_call(text, tools)``.
"""

from __future__ import annotations

import json
from typing import Any

from mlx_server.parsing.formats import json_header

tool_call_start = "<|python_tag|>"
tool_call_end = ""

# Llama 3.2 describes the JSON calls without <|python_tag|>. Tried after the formats with
# markers of their own, and after the Hermes JSON format.
template_markers = (("<|python_tag|>",), ("<|start_header_id|>", "ipython"))
priority = -2
# {"name": "f", "parameters": {...}}; {...}
stream_header = r"\s*;?" + json_header("parameters|arguments")
stream_closer = "}"
# A call may begin without the marker, as a bare JSON object at the start of the answer.
bare_start = True

_SEPARATORS = " \t\r\n;"


def parse_tool_call(text: str, tools: Any | None = None) -> dict | list[dict]:
    """Parse one or more ``{"name", "parameters"}`` objects; ValueError if any is not one."""
    decoder = json.JSONDecoder()
    calls = []
    pos = 0
    while True:
        while pos < len(text) and text[pos] in _SEPARATORS:
            pos += 1
        if pos >= len(text):
            break
        obj, pos = decoder.raw_decode(text, pos)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ValueError(f"Not a tool call: {text!r}")
        arguments = obj.get("parameters", obj.get("arguments", {}))
        calls.append({"name": obj["name"], "arguments": arguments})
    if not calls:
        raise ValueError("No tool call found.")
    return calls[0] if len(calls) == 1 else calls
