"""Responses API request → neutral ChatRequest.

The input items become chat-template messages (``items``), after the stored conversation a
``previous_response_id`` names; ``instructions`` the system message; function tools,
``tool_choice``, ``text.format`` and ``reasoning.effort`` their neutral equivalents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_server.errors import InvalidRequest, UnsupportedFeature
from mlx_server.parsing.tool_schema import validate_tools
from mlx_server.protocols.responses.items import merge_into, normalize_input, to_messages
from mlx_server.protocols.responses.schemas import CreateResponseRequest
from mlx_server.types import ChatRequest, SamplingParams, ToolChoice

# The Responses API's own defaults (the spec's `temperature` and `top_p` defaults).
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0

_THINKING_EFFORTS = {"low", "medium", "high", "xhigh"}


@dataclass(frozen=True)
class Adapted:
    """What a request becomes: the neutral request, its own input items (stored form), the
    function tools to echo in the response object, and its tool_choice as given."""

    chat: ChatRequest
    input_items: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    tool_choice: Any


def to_chat_request(
    body: CreateResponseRequest,
    history: list[dict[str, Any]],
    *,
    vision: bool = False,
) -> Adapted:
    """Map a validated request (after ``history``, a stored conversation) to the neutral one."""
    items = normalize_input(body.input, vision)
    echo_tools, chat_tools = _tools(body.tools)
    messages = to_messages([*history, *items], history=len(history))
    if body.instructions:
        messages = merge_into([{"role": "system", "content": body.instructions}], messages)
    if not messages:
        raise InvalidRequest("input is empty: send a string or at least one item", param="input")
    tool_choice = _tool_choice(body.tool_choice)
    chat = ChatRequest(
        messages=messages,
        sampling=SamplingParams(
            temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
            top_p=DEFAULT_TOP_P if body.top_p is None else body.top_p,
        ),
        max_tokens=body.max_output_tokens,
        ignore_eos=bool(body.ignore_eos),
        tools=chat_tools or None,
        tool_choice=tool_choice,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        template_kwargs=_template_kwargs(body),
        response_format=_response_format(body),
    )
    return Adapted(chat, items, echo_tools, body.tool_choice or "auto")


def _template_kwargs(body: CreateResponseRequest) -> dict[str, Any]:
    """``reasoning.effort`` → the chat template's thinking switch (and level, for templates
    that take one); absent leaves the template's default."""
    effort = body.reasoning.effort if body.reasoning is not None else None
    if effort is None:
        return {}
    kwargs: dict[str, Any] = {"enable_thinking": effort in _THINKING_EFFORTS}
    if effort in ("low", "medium", "high"):
        kwargs["reasoning_effort"] = effort
    return kwargs


def _response_format(body: CreateResponseRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.type == "json_schema":
        if not isinstance(fmt.schema_, dict):
            raise InvalidRequest(
                "text.format.schema must be a JSON schema object", param="text.format.schema"
            )
        return {"type": "json_schema", "schema": fmt.schema_, "name": fmt.name}
    raise InvalidRequest(
        f"text.format.type '{fmt.type}' is not supported (use text, json_object or json_schema)",
        param="text.format.type",
    )


# ---- tools -------------------------------------------------------------------------------


def _tools(tools: list[Any] | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(function tools in the response object's form, the same as chat-template tools)."""
    echo: list[dict[str, Any]] = []
    chat: list[dict[str, Any]] = []
    seen: set[str] = set()
    for k, t in enumerate(tools or []):
        where = f"tools[{k}]"
        if not isinstance(t, dict):
            raise InvalidRequest(f"{where} must be an object", param=where)
        kind = t.get("type")
        if kind != "function":
            raise UnsupportedFeature(
                f"{where} has type {kind!r}: only 'function' tools are supported (this server "
                "cannot run hosted tools such as web_search or file_search)",
                param=f"{where}.type",
            )
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"{where}.name: field required", param=f"{where}.name")
        if name in seen:
            raise InvalidRequest(
                f"{where}.name '{name}' is used by another tool; names must be unique",
                param=f"{where}.name",
            )
        seen.add(name)
        params = t.get("parameters")
        function: dict[str, Any] = {"name": name}
        if t.get("description") is not None:
            function["description"] = t.get("description")
        if params is not None:
            function["parameters"] = params
        chat.append({"type": "function", "function": function})
        echo.append(
            {
                "type": "function",
                "name": name,
                "description": t.get("description"),
                "parameters": params,
                "strict": t.get("strict"),
            }
        )
    try:
        validate_tools(chat)
    except ValueError as e:
        raise InvalidRequest(str(e), param="tools") from e
    return echo, chat


def _tool_choice(choice: str | dict[str, Any] | None) -> ToolChoice:
    """``ChatRequest.tool_choice``: "auto", "none", "required" or a named function."""
    if choice is None or isinstance(choice, str):
        return ToolChoice.of(choice or "auto")
    if choice.get("type") != "function":
        raise UnsupportedFeature(
            f"tool_choice of type {choice.get('type')!r} is not supported "
            "(use 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...})",
            param="tool_choice",
        )
    name = choice.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest("tool_choice.name: field required", param="tool_choice.name")
    return ToolChoice("function", name)
