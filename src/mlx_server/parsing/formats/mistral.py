"""Mistral's ``[TOOL_CALLS]f[ARGS]{...}`` (Mistral Small 3.2, Devstral, Magistral):
mlx-lm's parser (and detection), with argument streaming added."""

from __future__ import annotations

from mlx_lm.tool_parsers.mistral import parse_tool_call, tool_call_end, tool_call_start

__all__ = ["parse_tool_call", "tool_call_end", "tool_call_start"]

# The optional marker lets a call that follows another one repeat it.
stream_header = r"\s*(?:\[TOOL_CALLS\]\s*)?(?P<name>[\w.-]+)\s*\[ARGS\]\s*\{"
stream_closer = ""
# None here: mlx-lm detects it from the vocabulary's [TOOL_CALLS] token.
template_markers: tuple[tuple[str, ...], ...] = ()
