"""Which error envelope a path gets, and the app's error handlers that answer through it.

Each protocol registers the envelope of its paths (Anthropic's on ``/v1/messages``); every
other path gets the default one. Middleware (before routing) and the handlers (after) both
answer through the same ``Envelopes``, so a path never gets two shapes.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from mlx_server.errors import InvalidRequest, MethodNotAllowed, NotFound, Overloaded, ServerError
from mlx_server.logs import log

# (status, body, headers) for an error, in one protocol's shape.
Envelope = Callable[[ServerError], tuple[int, dict[str, Any], dict[str, str]]]


class Envelopes:
    """The error envelope of each path: the one registered for its longest prefix."""

    def __init__(self, default: Envelope):
        self.default = default
        self._by_prefix: list[tuple[str, Envelope]] = []

    def register(self, prefix: str, envelope: Envelope) -> None:
        self._by_prefix.append((prefix, envelope))
        self._by_prefix.sort(key=lambda pe: -len(pe[0]))

    def response(self, path: str, err: ServerError) -> tuple[int, dict[str, Any], dict[str, str]]:
        """(status, body, headers) for ``err`` on ``path``."""
        for prefix, envelope in self._by_prefix:
            if path.startswith(prefix):
                return envelope(err)
        return self.default(err)

    def json(
        self, path: str, err: ServerError, headers: dict[str, str] | None = None
    ) -> JSONResponse:
        status, body, extra = self.response(path, err)
        return JSONResponse(body, status_code=status, headers={**extra, **(headers or {})})

    async def send(
        self,
        send: Callable[[Any], Awaitable[None]],
        path: str,
        err: ServerError,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        """Answer ``err`` from raw ASGI middleware (before any route ran)."""
        status, body, extra = self.response(path, err)
        data = json.dumps(body).encode()
        hdrs = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
        ]
        hdrs += [(k.lower().encode(), v.encode()) for k, v in extra.items()]
        start = {"type": "http.response.start", "status": status, "headers": hdrs + (headers or [])}
        await send(start)
        await send({"type": "http.response.body", "body": data})


def install_error_handlers(app: FastAPI, envelopes: Envelopes) -> None:
    """Every exception a route raises answers in its path's envelope."""

    @app.exception_handler(ServerError)
    async def on_server_error(request: Request, exc: ServerError) -> JSONResponse:
        if exc.status >= 500 and not isinstance(exc, Overloaded):
            log(f"Error processing request: {exc.message}")
        return envelopes.json(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Query parameters (e.g. /v1/responses/{id}/input_items?limit=x); bodies are
        # validated by parse_body.
        err = InvalidRequest(f"invalid request: {exc.errors()}")
        return envelopes.json(request.url.path, err)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err: ServerError
        if exc.status_code == 404:
            err = NotFound(f"no route for {request.method} {request.url.path}")
        elif exc.status_code == 405:
            err = MethodNotAllowed(f"method {request.method} is not allowed on {request.url.path}")
        else:
            err = ServerError(str(exc.detail))
            err.status = exc.status_code
        return envelopes.json(request.url.path, err)

    @app.exception_handler(ClientDisconnect)
    async def on_client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # The client hung up before its body arrived: nobody reads this answer.
        log(f"Request to {request.url.path} abandoned by the client before its body arrived")
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def on_crash(request: Request, exc: Exception) -> JSONResponse:
        traceback.print_exc()
        log(f"Error processing request: {type(exc).__name__}: {exc}")
        err = ServerError(f"internal server error ({type(exc).__name__})")
        # Starlette re-raises the exception after this answer and the server then drops the
        # connection: say so, so keep-alive clients don't reuse it.
        return envelopes.json(request.url.path, err, {"Connection": "close"})
