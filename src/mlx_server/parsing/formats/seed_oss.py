"""ByteDance Seed-OSS: ``<seed:tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></seed:tool_call>``,
the body written as Qwen3-Coder writes it (parsed by mlx-lm's qwen3_coder)."""

from __future__ import annotations

from typing import Any

from mlx_lm.tool_parsers import qwen3_coder

tool_call_start = "<seed:tool_call>"
tool_call_end = "</seed:tool_call>"

# Detection: a chat template holding every string of one of these groups writes this
# format; formats are tried by descending priority.
template_markers = (("<seed:tool_call>",),)
priority = 7


def parse_tool_call(text: str, tools: Any = None) -> Any:
    return qwen3_coder.parse_tool_call(text, tools)
