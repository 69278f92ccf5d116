"""The error tree in Anthropic's envelope: ``{"type": "error", "error": {"type",
"message"}}``, with Anthropic's statuses (529 when overloaded). Every ``/v1/messages`` route
answers errors through this module, before routing (auth, size) and after."""

from __future__ import annotations

from typing import Any

from mlx_server.errors import ContextLengthExceeded, Overloaded, ServerError

# The paths whose errors take this envelope, before routing (auth, size) and after.
PATHS = ("/v1/messages",)
OVERLOADED_STATUS = 529  # Anthropic's, where OpenAI-style routes say 503


def error_json(kind: str, message: str) -> dict[str, Any]:
    """An error object (also the data of a stream's ``error`` event)."""
    return {"type": "error", "error": {"type": kind, "message": message}, "request_id": None}


def error_response(err: ServerError) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, body, headers) for ``err``."""
    if isinstance(err, Overloaded):
        headers = {"Retry-After": str(err.retry_after)}
        return OVERLOADED_STATUS, error_json(err.kind, err.message), headers
    body = error_json(err.kind, err.message)
    if isinstance(err, ContextLengthExceeded):  # the fields OpenAI and llama.cpp clients read
        body["error"].update(code=err.code, n_prompt_tokens=err.n_prompt_tokens, n_ctx=err.n_ctx)
    return err.status, body, {}


def context_error_message(prompt_tokens: int, max_tokens: int, ctx_size: int) -> str:
    """Anthropic's wording for a request that does not fit the context. Clients act on it:
    Claude Code compacts the conversation on the first, and lowers max_tokens on the second."""
    if prompt_tokens >= ctx_size:
        return f"prompt is too long: {prompt_tokens} tokens > {ctx_size} maximum"
    return (
        f"input length and `max_tokens` exceed context limit: {prompt_tokens} + {max_tokens} "
        f"> {ctx_size}, decrease input length or `max_tokens` and try again"
    )
