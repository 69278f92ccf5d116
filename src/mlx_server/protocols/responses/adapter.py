"""Responses API request → neutral ChatRequest.

Two steps. ``normalize_input`` checks the request's ``input`` item by item (each error names
its place, ``input[2].content[1]``) and returns the items in their stored form, each with an
id. ``to_messages`` renders a whole conversation of such items (a stored conversation's
items followed by the new ones) as chat-template messages: consecutive assistant-side items
(``reasoning``, assistant ``message``, ``function_call``) form one assistant turn, each
``function_call_output`` a ``tool`` message.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from mlx_server.errors import InvalidRequest, UnsupportedFeature
from mlx_server.parsing.tools import validate_tools
from mlx_server.protocols.responses.schemas import CreateResponseRequest
from mlx_server.types import ChatRequest, SamplingParams

# The Responses API's own defaults (the spec's `temperature` and `top_p` defaults).
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0

_INPUT_ROLES = {"user", "system", "developer", "assistant"}
_THINKING_EFFORTS = {"low", "medium", "high", "xhigh"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


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
    messages = to_messages([*history, *items])
    if body.instructions:
        messages = _merge_into([{"role": "system", "content": body.instructions}], messages)
    if not messages:
        raise InvalidRequest("input is empty: send a string or at least one item", param="input")
    tool_choice = _tool_choice(body.tool_choice, chat_tools)
    chat = ChatRequest(
        messages=messages,
        sampling=SamplingParams(
            temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
            top_p=DEFAULT_TOP_P if body.top_p is None else body.top_p,
        ),
        max_tokens=body.max_output_tokens,
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


def _tool_choice(choice: str | dict[str, Any] | None, tools: list[dict[str, Any]]) -> Any:
    """``ChatRequest.tool_choice``: "auto", "none", "required" or a named function."""
    if choice is None or isinstance(choice, str):
        return choice or "auto"
    if choice.get("type") != "function":
        raise UnsupportedFeature(
            f"tool_choice of type {choice.get('type')!r} is not supported "
            "(use 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...})",
            param="tool_choice",
        )
    name = choice.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest("tool_choice.name: field required", param="tool_choice.name")
    return {"type": "function", "function": {"name": name}}


# ---- input items -------------------------------------------------------------------------


def normalize_input(raw: str | list[Any], vision: bool) -> list[dict[str, Any]]:
    """The request's input as stored items (with ids); InvalidRequest names a bad item."""
    if isinstance(raw, str):
        return [_message_item({"role": "user", "content": raw}, "input", vision)]
    return [_item(item, f"input[{i}]", vision) for i, item in enumerate(raw)]


def _item(raw: Any, where: str, vision: bool) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{where} must be an object", param=where)
    kind = raw.get("type", "message")
    if kind == "message":
        return _message_item(raw, where, vision)
    if kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(raw.get(key), str):
                raise InvalidRequest(f"{where}.{key}: field required", param=f"{where}.{key}")
        _parse_arguments(raw["arguments"], f"{where}.arguments")
        return {
            "type": "function_call",
            "id": raw.get("id") or new_id("fc"),
            "call_id": raw["call_id"],
            "name": raw["name"],
            "arguments": raw["arguments"],
            "status": "completed",
        }
    if kind == "function_call_output":
        if not isinstance(raw.get("call_id"), str):
            raise InvalidRequest(f"{where}.call_id: field required", param=f"{where}.call_id")
        output = raw.get("output")
        if isinstance(output, list):
            output = [_part(p, f"{where}.output[{j}]", vision) for j, p in enumerate(output)]
        elif not isinstance(output, str):
            raise InvalidRequest(
                f"{where}.output must be a string or a list of parts", param=f"{where}.output"
            )
        return {
            "type": "function_call_output",
            "id": raw.get("id") or new_id("fco"),
            "call_id": raw["call_id"],
            "output": output,
            "status": "completed",
        }
    if kind == "reasoning":
        return {
            "type": "reasoning",
            "id": raw.get("id") or new_id("rs"),
            "summary": _texts(raw.get("summary"), "summary_text"),
            "content": _texts(raw.get("content"), "reasoning_text"),
        }
    raise UnsupportedFeature(
        f"{where} has type {kind!r}, which is not supported (supported: message, "
        "function_call, function_call_output, reasoning)",
        param=f"{where}.type",
    )


def _texts(parts: Any, kind: str) -> list[dict[str, Any]]:
    out = []
    for p in parts if isinstance(parts, list) else []:
        if isinstance(p, dict) and isinstance(p.get("text"), str):
            out.append({"type": kind, "text": p["text"]})
    return out


def _message_item(raw: dict[str, Any], where: str, vision: bool) -> dict[str, Any]:
    role = raw.get("role")
    if role not in _INPUT_ROLES:
        raise InvalidRequest(
            f"{where}.role {role!r} is not one of user, system, developer, assistant",
            param=f"{where}.role",
        )
    content = raw.get("content")
    if isinstance(content, str):
        text_type = "output_text" if role == "assistant" else "input_text"
        parts = [{"type": text_type, "text": content}]
    elif isinstance(content, list):
        parts = [_part(p, f"{where}.content[{j}]", vision) for j, p in enumerate(content)]
    else:
        raise InvalidRequest(
            f"{where}.content must be a string or a list of parts", param=f"{where}.content"
        )
    if role == "assistant":
        parts = [_as_output_text(p, f"{where}.content[{j}]") for j, p in enumerate(parts)]
        return {
            "type": "message",
            "id": raw.get("id") or new_id("msg"),
            "role": "assistant",
            "content": parts,
            "status": "completed",
        }
    item = {"type": "message", "id": raw.get("id") or new_id("msg"), "role": role}
    item["content"] = parts
    item["status"] = "completed"
    return item


def _as_output_text(part: dict[str, Any], where: str) -> dict[str, Any]:
    if part["type"] not in ("output_text", "input_text", "refusal"):
        raise InvalidRequest(f"{where}: an assistant message holds text only", param=where)
    text = part.get("text", part.get("refusal", ""))
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _part(raw: Any, where: str, vision: bool) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{where} must be an object", param=where)
    kind = raw.get("type")
    if kind in ("input_text", "output_text", "text"):
        if not isinstance(raw.get("text"), str):
            raise InvalidRequest(f"{where}.text: field required", param=f"{where}.text")
        if kind == "output_text":
            return {"type": kind, "text": raw["text"], "annotations": [], "logprobs": []}
        return {"type": "input_text", "text": raw["text"]}
    if kind == "refusal":
        return {"type": "refusal", "refusal": str(raw.get("refusal", ""))}
    if kind == "input_image":
        if not vision:
            raise InvalidRequest(
                f"{where} is an input_image part, but this model accepts text only", param=where
            )
        url = raw.get("image_url")
        if isinstance(url, dict):
            url = url.get("url")
        if not isinstance(url, str) or not url:
            what = "file_id references are not supported" if raw.get("file_id") else "required"
            raise InvalidRequest(f"{where}.image_url: {what}", param=f"{where}.image_url")
        return {"type": "input_image", "image_url": url, "detail": raw.get("detail") or "auto"}
    raise UnsupportedFeature(
        f"{where} has unsupported type {kind!r} (supported: input_text, input_image)",
        param=f"{where}.type",
    )


def _parse_arguments(text: str, where: str) -> dict[str, Any]:
    try:
        args = json.loads(text) if text.strip() else {}
    except ValueError as e:
        raise InvalidRequest(f"{where} is not valid JSON: {e}", param=where) from e
    if not isinstance(args, dict):
        raise InvalidRequest(f"{where} must be a JSON object", param=where)
    return args


# ---- items → chat-template messages ------------------------------------------------------


def to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation of stored items as chat-template messages."""
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the open assistant turn
    names: dict[str, str] = {}  # call_id → function name, for tool messages
    for i, item in enumerate(items):
        kind = item["type"]
        if kind == "message" and item["role"] != "assistant":
            turn = None
            role = "system" if item["role"] == "developer" else item["role"]
            out = _merge_into(out, [{"role": role, "content": _content(item, i)}])
            continue
        if kind == "function_call_output":
            turn = None
            msg = {"role": "tool", "content": _content(item, i), "tool_call_id": item["call_id"]}
            if item["call_id"] in names:
                msg["name"] = names[item["call_id"]]
            out.append(msg)
            continue
        reasoning = "\n".join(p["text"] for p in item.get("content") or item.get("summary") or [])
        if turn is None or (kind == "reasoning" and (turn["content"] or "tool_calls" in turn)):
            turn = {"role": "assistant", "content": ""}
            out.append(turn)
        if kind == "reasoning":
            if reasoning:
                turn["reasoning_content"] = reasoning
        elif kind == "message":
            text = "".join(p.get("text", "") for p in item["content"])
            turn["content"] = "\n".join(t for t in (turn["content"], text) if t)
        elif kind == "function_call":
            names[item["call_id"]] = item["name"]
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {
                    "name": item["name"],
                    "arguments": _parse_arguments(item["arguments"], f"input[{i}].arguments"),
                },
            }
            turn.setdefault("tool_calls", []).append(call)
    return out


def _content(item: dict[str, Any], i: int) -> str | list[dict[str, Any]]:
    """Text, or Hugging Face style parts when there are images (vision models only)."""
    raw = item.get("content", item.get("output"))
    if isinstance(raw, str):
        return raw
    parts: list[dict[str, Any]] = []
    key = "content" if "content" in item else "output"
    for j, p in enumerate(raw or []):
        if p["type"] == "input_image":
            part = {"type": "image", "image": p["image_url"], "param": f"input[{i}].{key}[{j}]"}
            if p.get("detail") in ("low", "high"):
                part["detail"] = p["detail"]
            parts.append(part)
        else:
            parts.append({"type": "text", "text": p.get("text", p.get("refusal", ""))})
    if any(p["type"] == "image" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def _merge_into(out: list[dict[str, Any]], messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Append ``messages``, joining a system or user message to a previous one of its role
    (templates that insist on alternating roles accept the result)."""
    out = list(out)
    for msg in messages:
        last = out[-1] if out else None
        if last is None or last["role"] != msg["role"] or msg["role"] not in ("system", "user"):
            out.append(msg)
            continue
        a, b = last["content"], msg["content"]
        if isinstance(a, str) and isinstance(b, str):
            content: Any = "\n\n".join(t for t in (a, b) if t)
        else:
            content = _as_parts(a) + _as_parts(b)
        out[-1] = {"role": msg["role"], "content": content}
    return out


def _as_parts(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(content, list):
        return content
    return [{"type": "text", "text": content}] if content else []
