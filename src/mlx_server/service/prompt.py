"""A chat request's prompt as the service prepares it: the rendered text and its tokens, the
answer's token budget within the context, and where the system prompt ends in the tokens
(what the prefix cache keeps for other conversations)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from mlx_server.errors import ContextLengthExceeded


@dataclass(frozen=True)
class PreparedPrompt:
    text: str
    tokens: list[int]
    max_tokens: int
    start_in_reasoning: bool
    vision_inputs: dict[str, Any] | None = None  # pixels etc. for a prompt with media


def answer_budget(prompt_n: int, max_tokens: int | None, ctx_size: int) -> int:
    """The answer's ``max_tokens``: as asked when prompt and answer fit the context, else
    what the context leaves; raises ContextLengthExceeded when that is nothing."""
    if max_tokens is not None:
        if prompt_n + max_tokens > ctx_size:
            raise ContextLengthExceeded.overflow(prompt_n, max_tokens, ctx_size, param="messages")
        return max_tokens
    left = ctx_size - prompt_n
    if left <= 0:
        raise ContextLengthExceeded.overflow(prompt_n, None, ctx_size, param="messages")
    return left


def system_prefix_tokens(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    prepared: PreparedPrompt,
    media: Collection[int] = (),
) -> int:
    """How many leading prompt tokens render the system prompt, up to where the first
    other message's content begins (its turn's header is the same in every conversation);
    0 if none. Found in the rendered prompt: the template runs once. ``media``: placeholder
    tokens (a first message's image is no part of the prefix)."""
    n = 0
    while n < len(messages) and messages[n].get("role") in ("system", "developer"):
        n += 1
    if n == len(messages):
        return 0
    end = _content_start(prepared.text, messages[:n], messages[n])
    if end <= 0:
        return 0
    head = tokenizer.encode(prepared.text[:end], add_special_tokens=False)
    common = 0
    for a, b in zip(head, prepared.tokens, strict=False):
        if a != b or b in media:
            break
        common += 1
    return common if common < len(prepared.tokens) else 0


def _content_start(text: str, system: list[dict[str, Any]], first: dict[str, Any]) -> int:
    """Where ``first``'s text content starts in the rendered ``text``, searched after the
    system messages' own text; -1 if any of them is not found as plain text (a template
    that rewrites them: no boundary)."""
    at = 0
    for message in [*system, first]:
        content = _first_text(message.get("content")).strip()
        found = text.find(content, at) if content else -1
        if found < 0:
            return -1
        if message is first:
            return found
        at = found + len(content)
    return -1


def _first_text(content: Any) -> str:
    """A message's text, or its first text part's."""
    if isinstance(content, str):
        return content
    for part in content if isinstance(content, list) else []:
        if isinstance(part, dict) and part.get("type") == "text":
            return str(part.get("text") or "")
    return ""
