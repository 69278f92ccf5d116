"""Prompt building: neutral chat messages through the model's chat template into token ids."""

from __future__ import annotations

import json
from typing import Any

from mlx_server.errors import InvalidRequest
from mlx_server.models.chat_template import ChatTemplate, TemplateError


def render_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    template: ChatTemplate | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """Render the whole conversation with the chat template, ending with the generation
    prompt (``add_generation_prompt``), or, with ``continue_final_message``, inside the
    final message: cut right after its text, so the model goes on writing it.

    ``template``: the model's probed Jinja template (see ``chat_template``); without it the
    tokenizer renders (a model that mlx-lm renders with Python code).
    Template errors (a template that rejects the conversation, e.g. roles that must
    alternate) are the caller's input problem: they become InvalidRequest.
    """
    add = add_generation_prompt and not continue_final_message
    text = _render(tokenizer, messages, tools, template_kwargs, template, add)
    return open_final_message(text, messages[-1]) if continue_final_message else text


def _render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any] | None,
    template: ChatTemplate | None,
    add_generation_prompt: bool,
) -> str:
    kwargs = dict(template_kwargs or {})
    if template is not None:
        try:
            return template.render(
                messages,
                tools=tools,
                template_kwargs=kwargs,
                add_generation_prompt=add_generation_prompt,
            )
        except TemplateError as e:
            raise InvalidRequest(
                f"the chat template could not render these messages: {e}", param="messages"
            ) from e
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **kwargs,
        )
    except InvalidRequest:
        raise
    except Exception as e:  # jinja2 errors, raise_exception() in templates, type errors
        raise InvalidRequest(
            f"the chat template could not render these messages: {e}", param="messages"
        ) from e
    if not isinstance(text, str):
        raise InvalidRequest("the chat template did not render to text", param="messages")
    return text


def open_final_message(text: str, final: dict[str, Any]) -> str:
    """The rendered conversation cut right after the final message's text, dropping what
    the template closes the turn with (end-of-turn token, newline). The text is found
    from the end; a template that trims the message's surrounding whitespace is allowed
    for. Raises InvalidRequest when the message has no text or the template dropped it."""
    content = final.get("content")
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        content = parts[-1] if parts else None
    if not isinstance(content, str) or not content.strip():
        raise InvalidRequest(
            "continue_final_message needs text in the final message to continue",
            param="messages",
        )
    core = content.strip()
    at = text.rfind(core)
    if at < 0:
        raise InvalidRequest(
            "continue_final_message: the chat template does not render the final message's "
            "text as it was sent, so it cannot be continued",
            param="messages",
        )
    tail = content[len(content) - len(content.lstrip()) :]  # the text from its first non-space
    end = at + (len(tail) if text.startswith(tail, at) else len(core))
    return text[:end]


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids for a rendered prompt (the template already placed any BOS token)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise InvalidRequest("the rendered prompt is empty", param="messages")
    return list(ids)


def history_tokens(tokenizer: Any, tokens: list[int], text: str, history: str) -> int:
    """How many leading ``tokens`` (the prompt ``text``'s) render ``history``, the same
    conversation rendered without the generation prompt: where the next turn's prompt can
    go another way (0 when ``text`` is not ``history`` and a generation prompt whose own
    tokens end ``tokens``)."""
    if not history or len(history) >= len(text) or not text.startswith(history):
        return 0
    tail = tokenizer.encode(text[len(history) :], add_special_tokens=False)
    n = len(tokens) - len(tail)
    return n if tail and n > 0 and list(tokens[n:]) == list(tail) else 0


def template_text(tokenizer: Any) -> str:
    tpl = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "chat_template", None)
    if isinstance(tpl, dict):
        return "\n".join(v for v in tpl.values() if isinstance(v, str))
    return tpl if isinstance(tpl, str) else ""


def _describe_tools(tools: list[dict[str, Any]], start: str, end: str, syntax: str = "") -> str:
    specs = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    how = (
        f"To call a function, write exactly: {syntax}"
        if syntax
        else f"To call a function, write {start} then a JSON object "
        f'{{"name": <function name>, "arguments": <arguments object>}} then {end}. '
        "Write one such block per call."
    )
    return (
        "You can call functions to help answer. These are the available functions, one JSON "
        f"signature per line:\n{specs}\n\n{how}"
    )


def inline_tools(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template: str,
    markers: tuple[str, str] = ("<tool_call>", "</tool_call>"),
    syntax: str = "",
) -> list[dict[str, Any]]:
    """For chat templates that know nothing of tools: describe the tools in the system
    message and write earlier tool calls into the assistant text, in the Hermes format the
    tool parser reads, so the model still sees the offered tools and its own calls."""
    start, end = markers
    out = [dict(m) for m in messages]
    if "tool_calls" not in template:
        for m in out:
            calls = m.pop("tool_calls", None)
            if calls:
                blocks = [
                    f"{start}\n{json.dumps(c['function'], ensure_ascii=False)}\n{end}"
                    for c in calls
                ]
                m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
    if tools and "tools" not in template:
        note = _describe_tools(tools, start, end, syntax)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{note}" if out[0].get("content") else note
        else:
            out.insert(0, {"role": "system", "content": note})
    return out
