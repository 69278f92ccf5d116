"""Request fields that several protocols declare or read alike."""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import AfterValidator

from mlx_server.errors import InvalidRequest


def _check_tool_choice(v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(v, str) and v not in ("none", "auto", "required"):
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or a function object")
    return v


# OpenAI's ``tool_choice`` (chat completions, responses): a mode or a function object.
ToolChoiceField = Annotated[str | dict[str, Any] | None, AfterValidator(_check_tool_choice)]


def tool_call(i: int, j: int, tc: Any) -> dict[str, Any]:
    """An assistant message's call ``j`` (OpenAI's shape: ``id``, ``function.name``,
    ``function.arguments``; Ollama's is the same) as the chat template reads it, ``arguments``
    an object. The JSON text some clients send, as OpenAI's API does, is parsed; message
    ``i``'s call without an id gets one."""
    args = tc.function.arguments
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as e:
            where = f"messages[{i}].tool_calls[{j}].function.arguments"
            raise InvalidRequest(f"{where} is not valid JSON: {e}", param=where) from e
    return {
        "id": tc.id or f"call_{i}_{j}",
        "type": "function",
        "function": {"name": tc.function.name, "arguments": args},
    }
