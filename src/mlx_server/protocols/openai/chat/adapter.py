"""OpenAI request → neutral ChatRequest."""

from __future__ import annotations

from typing import Any

from mlx_server.errors import InvalidRequest
from mlx_server.models.reasoning_effort import effort_kwargs
from mlx_server.parsing.tool_schema import validate_tools
from mlx_server.protocols.fields import tool_call
from mlx_server.protocols.openai.chat.schemas import ChatCompletionRequest, Message
from mlx_server.protocols.openai.sampling import sampling_params
from mlx_server.types import AUTO, ChatRequest, ToolChoice

_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


def to_chat_request(body: ChatCompletionRequest, *, vision: bool = False) -> ChatRequest:
    """Map a validated OpenAI request to the neutral request (raises InvalidRequest)."""
    messages = [_message(i, m, vision) for i, m in enumerate(body.messages)]
    tools = None
    if body.tools is not None:
        try:
            tools = validate_tools(body.tools)
        except ValueError as e:
            raise InvalidRequest(str(e), param="tools") from e
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is None and body.n_predict is not None and body.n_predict > 0:
        max_tokens = body.n_predict
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        try:
            effort = effort_kwargs(body.reasoning_effort)
        except ValueError as e:
            raise InvalidRequest(str(e), param="reasoning_effort") from e
        kwargs = {**effort, **kwargs}  # explicit chat_template_kwargs win
    add_generation_prompt, continue_final = template_controls(body)
    return ChatRequest(
        messages=messages,
        sampling=sampling_params(body),
        max_tokens=max_tokens,
        stop=stop,
        tools=tools or None,
        tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls is not False,
        logprobs=bool(body.logprobs),
        top_logprobs=(body.top_logprobs or 0) if body.logprobs else 0,
        template_kwargs=kwargs,
        reasoning_format="none" if body.reasoning_format == "none" else "auto",
        response_format=_response_format(body),
        ignore_eos=bool(body.ignore_eos),
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final,
        prediction=body.prediction.text if body.prediction is not None else None,
    )


def template_controls(body: ChatCompletionRequest) -> tuple[bool, bool]:
    """``add_generation_prompt`` and ``continue_final_message`` as vLLM defines them: the
    first defaults to true, unless the second is set; both true is refused; continuing
    needs a final assistant message to continue."""
    cont = bool(body.continue_final_message)
    if cont and body.add_generation_prompt:
        raise InvalidRequest(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
    if cont and body.messages[-1].role != "assistant":
        raise InvalidRequest(
            "continue_final_message needs the last message to be the assistant's",
            param="messages",
        )
    add = body.add_generation_prompt if body.add_generation_prompt is not None else not cont
    return add, cont


def _tool_choice(tc: str | dict[str, Any] | None) -> ToolChoice:
    """OpenAI's ``tool_choice`` (a mode, or ``{"type": "function", "function": {"name"}}``)."""
    if tc is None or tc == "auto":
        return AUTO
    if isinstance(tc, str):
        return ToolChoice.of(tc)  # "none" or "required": the schema allows nothing else
    fn = tc.get("function") if isinstance(tc.get("function"), dict) else tc
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise InvalidRequest(
            'tool_choice must name a function: {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    return ToolChoice("function", name)


def _response_format(body: ChatCompletionRequest) -> dict[str, Any] | None:
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return {"type": "json_object"}
    if rf.type == "json_schema":
        js = rf.json_schema or {}
        schema = js.get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequest(
                "response_format.json_schema.schema must be a JSON schema object",
                param="response_format.json_schema.schema",
            )
        return {"type": "json_schema", "schema": schema, "name": js.get("name")}
    raise InvalidRequest(
        f"response_format.type '{rf.type}' is not supported (use text, json_object or json_schema)",
        param="response_format.type",
    )


def _message(i: int, m: Message, vision: bool) -> dict[str, Any]:
    role = _ROLES.get(m.role)
    if role is None:
        raise InvalidRequest(
            f"messages[{i}].role '{m.role}' is not one of system, developer, user, assistant, tool",
            param=f"messages[{i}].role",
        )
    if m.content is None and not ((role == "assistant" and m.tool_calls) or m.images or m.videos):
        # Only an assistant turn that calls tools (or a message with Jan's legacy media
        # lists) may go without content, as in OpenAI's API.
        raise InvalidRequest(
            f"messages[{i}].content: field required", param=f"messages[{i}].content"
        )
    out: dict[str, Any] = {"role": role, "content": _content(i, m, vision)}
    if m.name:
        out["name"] = m.name
    if m.tool_calls and role == "assistant":
        out["tool_calls"] = [tool_call(i, j, tc) for j, tc in enumerate(m.tool_calls)]
    if m.tool_call_id and role == "tool":
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning_content and role == "assistant":
        out["reasoning_content"] = m.reasoning_content
    if (m.images or m.videos) and not vision:
        raise InvalidRequest(
            f"messages[{i}] has images or videos, but this model accepts text only",
            param=f"messages[{i}]",
        )
    return out


def _content(i: int, m: Message, vision: bool) -> str | list[dict[str, Any]]:
    """Text; or, with media (vision models only), Hugging Face style parts in order:
    ``{"type": "text", "text"}``, ``{"type": "image", "image": url}``,
    ``{"type": "video", "video": url}``, each media part with its ``param`` location."""
    parts: list[dict[str, Any]] = []
    if isinstance(m.content, str):
        parts.append({"type": "text", "text": m.content})
    for j, part in enumerate(m.content if isinstance(m.content, list) else []):
        parts.append(_part(f"messages[{i}].content[{j}]", part, vision))
    if vision:  # Jan's legacy per-message media lists, after the content's own
        for key, kind in (("images", "image"), ("videos", "video")):
            for k, url in enumerate(getattr(m, key) or []):
                parts.append({"type": kind, kind: url, "param": f"messages[{i}].{key}[{k}]"})
    if any(p["type"] != "text" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def _part(where: str, part: Any, vision: bool) -> dict[str, Any]:
    if part.type == "text":
        if part.text is None:
            raise InvalidRequest(f"{where} is a text part without 'text'", param=where)
        return {"type": "text", "text": part.text}
    if part.type not in ("image_url", "input_image", "video_url", "input_audio"):
        raise InvalidRequest(f"{where} has unsupported type '{part.type}'", param=where)
    if not vision:
        raise InvalidRequest(
            f"{where} is an {part.type} part, but this model accepts text only", param=where
        )
    if part.type == "input_audio":
        raise InvalidRequest(f"{where}: audio input is not supported", param=where)
    kind = "video" if part.type == "video_url" else "image"
    ref = part.video_url if kind == "video" else part.image_url
    url = ref if isinstance(ref, str) else getattr(ref, "url", None)
    if isinstance(ref, dict):
        url = ref.get("url")
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"{where}.{part.type}.url: field required", param=where)
    out = {"type": kind, kind: url, "param": where}
    detail = getattr(ref, "detail", None)
    if detail:
        out["detail"] = detail
    return out
