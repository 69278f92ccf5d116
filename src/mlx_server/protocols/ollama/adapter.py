"""Ollama request bodies → neutral requests.

``options`` become the sampling parameters (Ollama's own defaults where a field is absent),
``format`` the neutral ``response_format``, ``think`` the template's reasoning switches,
``images`` (bare base64) image parts for vision models. A ``/api/generate`` prompt becomes
one user turn through the chat template, unless ``raw`` or ``suffix`` asks for the text as
it is (``text_options`` then feeds the text-completion service).
"""

from __future__ import annotations

from typing import Any

from mlx_server.errors import InvalidRequest
from mlx_server.models.reasoning_effort import effort_kwargs
from mlx_server.parsing.tool_schema import validate_tools
from mlx_server.protocols.fields import tool_call
from mlx_server.protocols.ollama.schemas import (
    ChatBody,
    GenerateBody,
    GenerationBody,
    Message,
    Options,
)
from mlx_server.service.text_completion import CompletionOptions
from mlx_server.types import ChatRequest, SamplingParams

# Ollama's defaults for a Modelfile without these parameters (docs/modelfile.md).
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_P = 0.9
DEFAULT_TOP_K = 40
# What a raw /api/generate without num_predict may generate at most: the chat path runs to
# the end of the context, but raw text has no end-of-turn to stop at.
RAW_MAX_TOKENS = 128

_ROLES = ("system", "user", "assistant", "tool")
# The first bytes of base64 images, by format (Ollama sends no media type).
_MAGIC = (("iVBOR", "image/png"), ("/9j/", "image/jpeg"), ("R0lGOD", "image/gif"))


def sampling(options: Options | None) -> SamplingParams:
    o = options or Options()
    return SamplingParams(
        temperature=DEFAULT_TEMPERATURE if o.temperature is None else max(0.0, o.temperature),
        top_p=DEFAULT_TOP_P if o.top_p is None else o.top_p,
        top_k=DEFAULT_TOP_K if o.top_k is None else max(0, o.top_k),
        min_p=o.min_p or 0.0,
        repetition_penalty=o.repeat_penalty,
        presence_penalty=o.presence_penalty,
        frequency_penalty=o.frequency_penalty,
        seed=o.seed,
    )


def max_tokens(options: Options | None) -> int | None:
    """``num_predict``; negative (-1: no limit, -2: fill the context) means to the context's end."""
    n = options.num_predict if options is not None else None
    return None if n is None or n < 0 else n


def stop_strings(options: Options | None) -> tuple[str, ...]:
    stop = options.stop if options is not None else None
    if isinstance(stop, str):
        return (stop,) if stop else ()
    return tuple(s for s in stop or () if s)


def response_format(fmt: Any) -> dict[str, Any] | None:
    """``"json"`` → any JSON object; a schema object → that schema; ``""`` → free text."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    return {"type": "json_schema", "schema": fmt}


def think_kwargs(think: bool | str | None) -> dict[str, Any]:
    """Template variables for ``think``: on/off switches, or gpt-oss's effort level."""
    if think is None:
        return {}
    if isinstance(think, str):
        return effort_kwargs(think)
    # gpt-oss cannot turn reasoning off: false asks for the least of it.
    return {"enable_thinking": think, **({} if think else {"reasoning_effort": "low"})}


def to_chat_request(body: ChatBody, *, vision: bool) -> ChatRequest:
    """``/api/chat`` → the neutral chat request (raises InvalidRequest naming the field)."""
    tools = None
    if body.tools:
        try:
            tools = validate_tools(body.tools)
        except ValueError as e:
            raise InvalidRequest(str(e), param="tools") from e
    messages = [_message(i, m, vision) for i, m in enumerate(body.messages)]
    return _chat(body, messages, tools)


def generate_chat_request(body: GenerateBody, *, vision: bool) -> ChatRequest:
    """``/api/generate`` (not raw): the prompt as one user turn after the ``system`` one."""
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": body.system})
    user = Message(role="user", content=body.prompt or "", images=body.images)
    messages.append(_message(0, user, vision, where="prompt"))
    return _chat(body, messages, None)


def text_options(body: GenerateBody) -> CompletionOptions:
    """A raw or fill-in-the-middle ``/api/generate``: options of a text completion."""
    n = max_tokens(body.options)
    return CompletionOptions(
        max_tokens=RAW_MAX_TOKENS if n is None else n,
        sampling=sampling(body.options),
        stop=stop_strings(body.options),
        top_logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        response_format=response_format(body.format),
    )


def _chat(
    body: GenerationBody, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> ChatRequest:
    return ChatRequest(
        messages=messages,
        sampling=sampling(body.options),
        max_tokens=max_tokens(body.options),
        stop=stop_strings(body.options),
        tools=tools or None,
        logprobs=bool(body.logprobs),
        top_logprobs=(body.top_logprobs or 0) if body.logprobs else 0,
        template_kwargs=think_kwargs(body.think),
        response_format=response_format(body.format),
    )


def _message(i: int, m: Message, vision: bool, where: str | None = None) -> dict[str, Any]:
    where = where or f"messages[{i}]"
    if m.role not in _ROLES:
        raise InvalidRequest(
            f"{where}.role '{m.role}' is not one of {', '.join(_ROLES)}", param=f"{where}.role"
        )
    out: dict[str, Any] = {"role": m.role, "content": _content(where, m, vision)}
    if m.thinking and m.role == "assistant":
        out["reasoning_content"] = m.thinking
    if m.tool_calls and m.role == "assistant":
        out["tool_calls"] = [tool_call(i, j, tc) for j, tc in enumerate(m.tool_calls)]
    if m.role == "tool":
        if m.tool_name:
            out["name"] = m.tool_name
        if m.tool_call_id:
            out["tool_call_id"] = m.tool_call_id
    return out


def _content(where: str, m: Message, vision: bool) -> str | list[dict[str, Any]]:
    text = m.content or ""
    if not m.images:
        return text
    if not vision:
        raise InvalidRequest(
            f"{where}.images: this model accepts text only", param=f"{where}.images"
        )
    parts: list[dict[str, Any]] = [
        {"type": "image", "image": _data_url(b64), "param": f"{where}.images[{k}]"}
        for k, b64 in enumerate(m.images)
    ]
    return [*parts, {"type": "text", "text": text}]


def _data_url(b64: str) -> str:
    if b64.startswith("data:"):
        return b64
    media = next((t for magic, t in _MAGIC if b64.startswith(magic)), "image/webp")
    return f"data:{media};base64,{b64}"
