"""NVIDIA Nemotron Nano v2: ``<TOOLCALL>[{"name": ..., "arguments": {...}}]</TOOLCALL>``."""

from __future__ import annotations

from typing import Any

from mlx_server.parsing.formats import json_calls

tool_call_start = "<TOOLCALL>"
tool_call_end = "</TOOLCALL>"


def parse_tool_call(text: str, tools: Any = None) -> list[dict[str, Any]]:
    return json_calls(text)
