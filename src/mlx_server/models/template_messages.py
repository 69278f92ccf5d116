"""Messages in the shape a model's chat template reads (``prepare_messages``): what the
template was probed to need at load (``template_probe.TemplateCaps``) applied to the
request's messages: nulls dropped, tool-call arguments as an object or a JSON string,
9-character call ids, the system prompt and tool results written into user turns where the
template has no role for them, reasoning under the keys templates read."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from mlx_server.models.template_probe import TemplateCaps
from mlx_server.parsing.json_scan import loads

_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def prepare_messages(messages: list[dict[str, Any]], caps: TemplateCaps) -> list[dict[str, Any]]:
    """Messages in the shape this template reads.

    Keys whose value is None are dropped (templates handle a missing key better than a null
    one), except the null content of an assistant turn that only calls tools where the
    template needs it. Tool-call arguments become a JSON string where the template
    concatenates them. Reasoning is given under both ``reasoning_content`` and ``thinking``.
    """
    out: list[dict[str, Any]] = []
    for message in _polyfill(messages, caps):
        m = {k: v for k, v in message.items() if v is not None}
        calls = m.get("tool_calls")
        if calls:
            m["tool_calls"] = [_call_for(c, caps) for c in calls]
            if m.get("content") in (None, "") and m.get("role") == "assistant":
                if caps.null_content_with_calls:
                    m["content"] = None
                else:
                    m["content"] = ""
        if caps.short_call_ids and isinstance(m.get("tool_call_id"), str):
            m["tool_call_id"] = short_call_id(m["tool_call_id"])
        reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k)), None)
        text = m.get("content")
        if caps.text_into_reasoning and reasoning and calls and isinstance(text, str) and text:
            reasoning, m["content"] = f"{reasoning}\n\n{text}", ""
        if reasoning is not None:
            m["reasoning_content"] = m["thinking"] = reasoning
        out.append(m)
    return out


def _polyfill(messages: list[dict[str, Any]], caps: TemplateCaps) -> list[dict[str, Any]]:
    """Roles the template refuses or ignores, written into user turns: the system prompt
    (``merge_system``) and tool results (``tool_results_as_user``, in the ``<tool_response>``
    form the tool-call prompt describes). Adjacent user turns are then joined."""
    if not caps.merge_system and not caps.tool_results_as_user:
        return messages
    out: list[dict[str, Any]] = []
    system: list[str] = []
    for message in messages:
        role = message.get("role")
        content = message.get("content")
        if caps.merge_system and role == "system" and isinstance(content, str):
            system.append(content)
            continue
        if caps.tool_results_as_user and role == "tool" and isinstance(content, str):
            message = {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
        if role in ("user", "tool") and system and isinstance(message.get("content"), str):
            message = {**message, "content": "\n\n".join([*system, message["content"]])}
            system = []
        last = out[-1] if out else None
        if (
            last is not None
            and last.get("role") == "user" == message.get("role")
            and isinstance(last.get("content"), str)
            and isinstance(message.get("content"), str)
        ):
            out[-1] = {**last, "content": f"{last['content']}\n\n{message['content']}"}
        else:
            out.append(message)
    return out


def short_call_id(call_id: str) -> str:
    """A call id as 9 letters and digits: kept if it is one, else derived from it (so a call
    and its result still match)."""
    if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _call_for(call: dict[str, Any], caps: TemplateCaps) -> dict[str, Any]:
    string_arguments = caps.string_arguments
    if caps.short_call_ids and isinstance(call.get("id"), str):
        call = {**call, "id": short_call_id(call["id"])}
    function = call.get("function")
    if not isinstance(function, dict):
        return call
    args = function.get("arguments")
    if string_arguments and not isinstance(args, str):
        args = json.dumps(args if args is not None else {}, ensure_ascii=False)
    elif not string_arguments and isinstance(args, str):
        try:
            parsed = loads(args) if args.strip() else {}
        except ValueError:
            parsed = None
        args = parsed if isinstance(parsed, dict) else args
    return {**call, "function": {**function, "arguments": args}}
