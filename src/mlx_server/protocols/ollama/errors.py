"""The error tree in Ollama's shape: ``{"error": "message"}`` with the status of the error
(Ollama's server answers 400 for a bad request, 404 for an unknown model, 500 otherwise).
Every ``/api/`` route answers errors through this module, before routing and after."""

from __future__ import annotations

from typing import Any

from mlx_server.errors import Overloaded, ServerError

PATHS = ("/api/",)


def error_response(err: ServerError) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, body, headers) for ``err``."""
    headers = {"Retry-After": str(err.retry_after)} if isinstance(err, Overloaded) else {}
    return err.status, {"error": err.message}, headers
