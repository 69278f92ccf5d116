"""Which protocol's error envelope a path gets: Anthropic's on ``/v1/messages``, OpenAI's
everywhere else. Middleware (before routing) and the app's handlers (after) both answer
through here, so a path never gets two shapes."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.responses import JSONResponse

from mlx_server.errors import ServerError
from mlx_server.protocols.anthropic import errors as anthropic_errors
from mlx_server.protocols.openai import errors as openai_errors


def error_response(path: str, err: ServerError) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, body, headers) for ``err`` on ``path``."""
    if path.startswith("/v1/messages"):
        return anthropic_errors.error_response(err)
    return openai_errors.error_response(err)


def json_error(path: str, err: ServerError, headers: dict[str, str] | None = None) -> JSONResponse:
    status, body, extra = error_response(path, err)
    return JSONResponse(body, status_code=status, headers={**extra, **(headers or {})})


async def send_error(
    send: Callable[[Any], Awaitable[None]],
    path: str,
    err: ServerError,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """Answer ``err`` from raw ASGI middleware (before any route ran)."""
    status, body, extra = error_response(path, err)
    data = json.dumps(body).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in extra.items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs + (headers or [])})
    await send({"type": "http.response.body", "body": data})
