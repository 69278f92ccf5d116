"""DeepSeek R1 and V3.1 tool calls.

R1: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``
V3.1: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``
"""

from __future__ import annotations

import re
from typing import Any

from mlx_server.parsing.json_scan import loads

tool_call_start = "<｜tool▁calls▁begin｜>"
tool_call_end = "<｜tool▁calls▁end｜>"

# Detection: a chat template holding every string of one of these groups writes this
# format; formats are tried by descending priority.
template_markers = (("<｜tool▁calls▁begin｜>",),)
priority = 10

# DeepSeek's templates do not show the tools: they are described in the system message,
# with the call syntax of DeepSeek V3.1's model card.
call_syntax = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>FUNCTION_NAME<｜tool▁sep｜>"
    "ARGUMENTS_JSON_OBJECT<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
)

_CALL = re.compile(
    r"<｜tool▁call▁begin｜>\s*(?:function\s*<｜tool▁sep｜>\s*(?P<r1name>[^\n<]+?)\s*\n```(?:json)?\s*"
    r"(?P<r1args>.*?)\s*```|(?P<name>[^<]+?)\s*<｜tool▁sep｜>(?P<args>.*?))\s*<｜tool▁call▁end｜>",
    re.DOTALL,
)


def parse_tool_call(text: str, tools: Any = None) -> list[dict[str, Any]]:
    calls = []
    for m in _CALL.finditer(text):
        name = m.group("r1name") or m.group("name")
        raw = m.group("r1args") if m.group("r1name") else m.group("args")
        calls.append({"name": name.strip(), "arguments": loads(raw)})
    if not calls:
        raise ValueError("no DeepSeek tool call")
    return calls
