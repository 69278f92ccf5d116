"""Request fields that several protocols declare or read alike."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator

from mlx_server.errors import InvalidRequest
from mlx_server.parsing.json_scan import loads
from mlx_server.server.http import check_json_values


def _check_tool_choice(v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(v, str) and v not in ("none", "auto", "required"):
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or a function object")
    return v


# OpenAI's ``tool_choice`` (chat completions, responses): a mode or a function object.
ToolChoiceField = Annotated[str | dict[str, Any] | None, AfterValidator(_check_tool_choice)]


def parse_arguments(text: str, where: str) -> Any:
    """A call's ``arguments`` sent as JSON text, parsed (empty: ``{}``). Text that is not
    JSON, nests deeper than a body may, or holds a lone surrogate is refused naming
    ``where``: the body's own checks do not see inside a string."""
    try:
        value = loads(text) if text.strip() else {}
    except ValueError as e:
        raise InvalidRequest(f"{where} is not valid JSON: {e}", param=where) from e
    check_json_values(value, where)
    return value


def tool_call(i: int, j: int, tc: Any) -> dict[str, Any]:
    """An assistant message's call ``j`` (OpenAI's shape: ``id``, ``function.name``,
    ``function.arguments``; Ollama's is the same) as the chat template reads it, ``arguments``
    an object. The JSON text some clients send, as OpenAI's API does, is parsed; message
    ``i``'s call without an id gets one."""
    args = tc.function.arguments
    if isinstance(args, str):
        args = parse_arguments(args, f"messages[{i}].tool_calls[{j}].function.arguments")
    return {
        "id": tc.id or f"call_{i}_{j}",
        "type": "function",
        "function": {"name": tc.function.name, "arguments": args},
    }
