"""Phi-4-mini: ``<|tool_call|>{"name": ..., "arguments": {...}}<|/tool_call|>`` (or a list)."""

from __future__ import annotations

from typing import Any

from mlx_server.parsing.formats import json_calls

tool_call_start = "<|tool_call|>"
tool_call_end = "<|/tool_call|>"


def parse_tool_call(text: str, tools: Any = None) -> list[dict[str, Any]]:
    return json_calls(text)
