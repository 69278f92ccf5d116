"""Responses API input items: validation into their stored form, and conversations of
stored items as chat-template messages.

``normalize_input`` checks a request's ``input`` item by item (each error names its place,
``input[2].content[1]``) and returns the items as stored, each with an id. ``to_messages``
renders a whole conversation of such items (a stored conversation's items followed by the
new ones): consecutive assistant-side items (``reasoning``, assistant ``message``,
``function_call``) form one assistant turn, each ``function_call_output`` a ``tool`` message.
"""

from __future__ import annotations

import uuid
from typing import Any

from mlx_server.errors import InvalidRequest, UnsupportedFeature
from mlx_server.protocols.fields import parse_arguments

_INPUT_ROLES = {"user", "system", "developer", "assistant"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


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
            "id": _item_id(raw, where, "fc"),
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
            "id": _item_id(raw, where, "fco"),
            "call_id": raw["call_id"],
            "output": output,
            "status": "completed",
        }
    if kind == "reasoning":
        return {
            "type": "reasoning",
            "id": _item_id(raw, where, "rs"),
            "summary": _texts(raw.get("summary"), "summary_text"),
            "content": _texts(raw.get("content"), "reasoning_text"),
        }
    raise UnsupportedFeature(
        f"{where} has type {kind!r}, which is not supported (supported: message, "
        "function_call, function_call_output, reasoning)",
        param=f"{where}.type",
    )


def _item_id(raw: dict[str, Any], where: str, prefix: str) -> str:
    """An input item's own id (kept, and listed by ``input_items``), or a new one."""
    given = raw.get("id")
    if given is None or given == "":
        return new_id(prefix)
    if not isinstance(given, str):
        raise InvalidRequest(f"{where}.id must be a string", param=f"{where}.id")
    return given


def _texts(parts: Any, kind: str) -> list[dict[str, Any]]:
    out = []
    for p in parts if isinstance(parts, list) else []:
        if isinstance(p, dict) and isinstance(p.get("text"), str):
            out.append({"type": kind, "text": p["text"]})
    return out


def _message_item(raw: dict[str, Any], where: str, vision: bool) -> dict[str, Any]:
    role = raw.get("role")
    if not isinstance(role, str) or role not in _INPUT_ROLES:
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
            "id": _item_id(raw, where, "msg"),
            "role": "assistant",
            "content": parts,
            "status": "completed",
        }
    item: dict[str, Any] = {"type": "message", "id": _item_id(raw, where, "msg"), "role": role}
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
        detail = raw.get("detail") or "auto"
        if not isinstance(detail, str):
            raise InvalidRequest(f"{where}.detail must be a string", param=f"{where}.detail")
        return {"type": "input_image", "image_url": url, "detail": detail}
    raise UnsupportedFeature(
        f"{where} has unsupported type {kind!r} (supported: input_text, input_image)",
        param=f"{where}.type",
    )


def _parse_arguments(text: str, where: str) -> dict[str, Any]:
    args = parse_arguments(text, where)
    if not isinstance(args, dict):
        raise InvalidRequest(f"{where} must be a JSON object", param=where)
    return args


# ---- items → chat-template messages ------------------------------------------------------


def to_messages(items: list[dict[str, Any]], history: int = 0) -> list[dict[str, Any]]:
    """A conversation of stored items as chat-template messages. The first ``history`` items
    come from a stored conversation; error locations name the others as ``input[i]``."""
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the open assistant turn
    names: dict[str, str] = {}  # call_id → function name, for tool messages
    for n, item in enumerate(items):
        where = f"input[{n - history}]" if n >= history else "previous_response_id"
        kind = item["type"]
        if kind == "message" and item["role"] != "assistant":
            turn = None
            role = "system" if item["role"] == "developer" else item["role"]
            out = merge_into(out, [{"role": role, "content": _content(item, where)}])
            continue
        if kind == "function_call_output":
            turn = None
            msg = {
                "role": "tool",
                "content": _content(item, where),
                "tool_call_id": item["call_id"],
            }
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
                    "arguments": _parse_arguments(item["arguments"], f"{where}.arguments"),
                },
            }
            turn.setdefault("tool_calls", []).append(call)
    return out


def _content(item: dict[str, Any], where: str) -> str | list[dict[str, Any]]:
    """Text, or Hugging Face style parts when there are images (vision models only)."""
    raw = item.get("content", item.get("output"))
    if isinstance(raw, str):
        return raw
    parts: list[dict[str, Any]] = []
    key = "content" if "content" in item else "output"
    for j, p in enumerate(raw or []):
        if p["type"] == "input_image":
            part = {"type": "image", "image": p["image_url"], "param": f"{where}.{key}[{j}]"}
            if p.get("detail") in ("low", "high"):
                part["detail"] = p["detail"]
            parts.append(part)
        else:
            parts.append({"type": "text", "text": p.get("text", p.get("refusal", ""))})
    if any(p["type"] == "image" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def merge_into(out: list[dict[str, Any]], messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
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
