"""Hermes-style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen
2.5/3): mlx-lm's parser, with what this package adds (detection, argument streaming)."""

from __future__ import annotations

from mlx_lm.tool_parsers.json_tools import parse_tool_call, tool_call_end, tool_call_start

from mlx_server.parsing.formats import json_header

__all__ = ["parse_tool_call", "tool_call_end", "tool_call_start"]

# The most common format: the last guess for a template that writes <tool_call>.
template_markers = (("<tool_call>",),)
priority = -1
stream_header = json_header("arguments|parameters")
stream_closer = "}"
