"""Which grammar constraint a chat request asks for: response_format, or an enforced tool choice."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mlx_server.errors import InvalidRequest
from mlx_server.logs import log
from mlx_server.parsing.tool_formats import ToolFormat
from mlx_server.types import ChatRequest

if TYPE_CHECKING:
    from mlx_server.engine.grammar.spec import ConstraintSpec


def forced_tool(chat: ChatRequest) -> tuple[bool, str | None]:
    """(a tool call is required, the function name it must call or None)."""
    tc = chat.tool_choice
    return tc.forced, tc.name if tc.mode == "function" else None


def constraint_spec(chat: ChatRequest, tool_format: ToolFormat | None) -> ConstraintSpec | None:
    """The ConstraintSpec for a request, or None; InvalidRequest for what cannot be enforced."""
    from mlx_server.engine.grammar.spec import ConstraintError, ConstraintSpec, validate_spec

    required, name = forced_tool(chat)
    spec = None
    try:
        if required:
            if not chat.tools:
                raise InvalidRequest(
                    "tool_choice requires a tool call, but the request offers no tools",
                    param="tool_choice",
                )
            names = [t["function"]["name"] for t in chat.tools]
            if name is not None and name not in names:
                raise InvalidRequest(
                    f"tool_choice names '{name}', which is not among the offered tools ({', '.join(names)})",
                    param="tool_choice",
                )
            if tool_format is None or tool_format.name != "json_tools":
                fmt = tool_format.name if tool_format is not None else "none"
                log(
                    f"tool_choice is advisory for the '{fmt}' tool-call format (only JSON-body calls are enforced)"
                )
                return None
            spec = ConstraintSpec.tool_call(
                chat.tools, name, start=tool_format.start, end=tool_format.end
            )
        elif chat.response_format is not None:
            return format_spec(chat.response_format)
        if spec is not None:
            validate_spec(spec)
    except ConstraintError as e:
        param = "tools" if required else "response_format"
        raise InvalidRequest(f"cannot enforce this {param}: {e}", param=param) from e
    return spec


def format_spec(response_format: dict[str, Any]) -> ConstraintSpec:
    """The ConstraintSpec of a ``response_format`` (``json_object`` or ``json_schema`` with
    its ``schema``), validated; InvalidRequest for what cannot be enforced."""
    from mlx_server.engine.grammar.spec import ConstraintError, ConstraintSpec, validate_spec

    try:
        spec = (
            ConstraintSpec.json_object()
            if response_format["type"] == "json_object"
            else ConstraintSpec.json_schema(response_format["schema"])
        )
        validate_spec(spec)
    except ConstraintError as e:
        raise InvalidRequest(
            f"cannot enforce this response_format: {e}", param="response_format"
        ) from e
    return spec
