"""The error tree in OpenAI's envelope: ``{"error": {"message", "type", "param", "code"}}``.
Every OpenAI-style route (chat, completions, responses, tokenizer, ``/v1/cancel``) answers
errors through this module."""

from __future__ import annotations

from typing import Any

from mlx_server.errors import AuthenticationFailed, ContextLengthExceeded, Overloaded, ServerError

# Jan's exact 401 body on the OpenAI routes.
JAN_UNAUTHORIZED = {
    "error": {"message": "Unauthorized", "type": "authentication_error", "code": "unauthorized"}
}
# OpenAI's error types for our kinds that it has no name for.
_TYPES = {"overloaded_error": "server_error", "api_error": "server_error"}


def error_body(err: ServerError) -> dict[str, Any]:
    if isinstance(err, AuthenticationFailed):
        return JAN_UNAUTHORIZED
    kind = _TYPES.get(err.kind, err.kind)
    error: dict[str, Any] = {
        "message": err.message,
        "type": kind,
        "param": err.param,
        "code": err.code,
    }
    if isinstance(err, ContextLengthExceeded):  # llama.cpp's fields, which clients read
        error.update(n_prompt_tokens=err.n_prompt_tokens, n_ctx=err.n_ctx)
    return {"error": error}


def error_response(err: ServerError) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, body, headers) for ``err``."""
    headers = {"Retry-After": str(err.retry_after)} if isinstance(err, Overloaded) else {}
    return err.status, error_body(err), headers


def stream_error(message: str) -> dict[str, Any]:
    """The data of the error event that ends a stream which failed after it began."""
    return error_body(ServerError(message))
