"""Prompt building: neutral chat messages through the model's chat template into token ids."""

from __future__ import annotations

from typing import Any

from mlx_server.errors import InvalidRequest


def render_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """Render the whole conversation with the chat template, ending with the generation prompt.

    Template errors (a template that rejects the conversation, e.g. roles that must
    alternate) are the caller's input problem: they become InvalidRequest.
    """
    kwargs = dict(template_kwargs or {})
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=True,
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


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids for a rendered prompt (the template already placed any BOS token)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise InvalidRequest("the rendered prompt is empty", param="messages")
    return list(ids)
