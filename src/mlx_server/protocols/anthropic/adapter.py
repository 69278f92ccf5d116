"""Anthropic Messages request → neutral ChatRequest: sampling, tools, tool choice, thinking
and structured output here; the messages themselves in ``messages``."""

from __future__ import annotations

from typing import Any

from mlx_server.errors import InvalidRequest, UnsupportedFeature
from mlx_server.models.reasoning_effort import effort_from_budget, effort_level
from mlx_server.parsing.tool_schema import validate_tools
from mlx_server.protocols.anthropic.messages import MessageConverter
from mlx_server.protocols.anthropic.schemas import (
    CountTokensRequest,
    MessagesRequest,
    ToolChoice,
    ToolDefinition,
)
from mlx_server.types import AUTO, NO_TOOLS, ChatRequest, SamplingParams
from mlx_server.types import ToolChoice as NeutralToolChoice

ANTHROPIC_DEFAULT_TEMPERATURE = 1.0


def to_chat_request(
    body: MessagesRequest | CountTokensRequest, *, vision: bool = False
) -> ChatRequest:
    """Map a validated Messages (or count_tokens) request to the neutral request.

    Raises InvalidRequest naming the offending field. ``tool_choice`` ``any``/``tool``
    becomes OpenAI-style ``"required"`` / a named function, which the service enforces
    with a grammar where the model's tool-call format allows it.
    """
    tools = to_tools(body.tools)
    tool_choice, parallel = to_tool_choice(body.tool_choice, tools)
    messages = MessageConverter(vision).convert(body.system, body.messages)
    kwargs: dict[str, Any] = {}
    if body.thinking is not None:
        kwargs["enable_thinking"] = body.thinking.type != "disabled"
        # gpt-oss cannot turn reasoning off: disabled asks for the least of it.
        disabled = body.thinking.type == "disabled"
        kwargs["reasoning_effort"] = (
            "low" if disabled else effort_from_budget(body.thinking.budget_tokens)
        )
    effort = body.output_config.effort if body.output_config is not None else None
    if effort and effort_level(effort):
        kwargs["reasoning_effort"] = effort_level(effort)
    req = body if isinstance(body, MessagesRequest) else None
    return ChatRequest(
        messages=messages,
        sampling=_sampling(req),
        max_tokens=req.max_tokens if req else None,
        stop=tuple(s for s in (req.stop_sequences or []) if s) if req else (),
        ignore_eos=bool(req.ignore_eos) if req else False,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        template_kwargs=kwargs,
        response_format=_response_format(body),
    )


def _response_format(body: MessagesRequest | CountTokensRequest) -> dict[str, Any] | None:
    """``output_config.format`` (structured output) → the neutral ``response_format``."""
    fmt = body.output_config.format if body.output_config is not None else None
    if fmt is None:
        return None
    if fmt.get("type") != "json_schema":
        raise InvalidRequest(
            f"output_config.format.type {fmt.get('type')!r} is not supported (use 'json_schema')",
            param="output_config.format.type",
        )
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequest(
            "output_config.format.schema must be a JSON schema object",
            param="output_config.format.schema",
        )
    return {"type": "json_schema", "schema": schema}


def _sampling(req: MessagesRequest | None) -> SamplingParams:
    if req is None:
        return SamplingParams(temperature=ANTHROPIC_DEFAULT_TEMPERATURE)
    return SamplingParams(
        temperature=ANTHROPIC_DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
    )


# ---- system ------------------------------------------------------------------------------


# ---- tools -------------------------------------------------------------------------------


def to_tools(defs: list[ToolDefinition] | None) -> list[dict[str, Any]] | None:
    """Anthropic tool definitions → OpenAI-style function tools (what chat templates take)."""
    if not defs:
        return None
    tools: list[dict[str, Any]] = []
    seen: set[str] = set()
    for k, t in enumerate(defs):
        if t.type not in (None, "custom"):
            raise UnsupportedFeature(
                f"tools[{k}] is a server tool of type '{t.type}', which this server cannot run",
                param=f"tools[{k}].type",
            )
        if t.input_schema is None:
            raise InvalidRequest(f"tools[{k}].input_schema: field required", param=f"tools[{k}]")
        if t.name in seen:
            raise InvalidRequest(
                f"tools[{k}].name '{t.name}' is used by another tool; names must be unique",
                param=f"tools[{k}].name",
            )
        seen.add(t.name)
        function: dict[str, Any] = {"name": t.name}
        if t.description:
            function["description"] = t.description
        function["parameters"] = t.input_schema
        tools.append({"type": "function", "function": function})
    try:
        return validate_tools(tools)
    except ValueError as e:
        raise InvalidRequest(str(e), param="tools") from e


def to_tool_choice(
    choice: ToolChoice | None, tools: list[dict[str, Any]] | None
) -> tuple[NeutralToolChoice, bool]:
    """``(ChatRequest.tool_choice, parallel_tool_calls)`` for an Anthropic ``tool_choice``."""
    if choice is None:
        return AUTO, True
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "auto":
        return AUTO, parallel
    if choice.type == "none":
        return NO_TOOLS, parallel
    if not tools:
        raise InvalidRequest(
            f"tool_choice.type '{choice.type}' needs at least one tool in 'tools'",
            param="tool_choice",
        )
    if choice.type == "any":
        return NeutralToolChoice("required"), parallel
    names = [t["function"]["name"] for t in tools]
    if not choice.name:
        raise InvalidRequest("tool_choice.name: field required", param="tool_choice.name")
    if choice.name not in names:
        raise InvalidRequest(
            f"tool_choice.name '{choice.name}' is not one of the tools: {', '.join(names)}",
            param="tool_choice.name",
        )
    return NeutralToolChoice("function", choice.name), parallel
