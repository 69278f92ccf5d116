"""Pure ASGI middleware: API-key auth on /v1 routes and the request-body size limit.

Written as raw ASGI (not BaseHTTPMiddleware) so streaming responses and client-disconnect
detection pass through untouched.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from mlx_server.errors import AuthenticationFailed, NotFound, RequestTooLarge, ServerError

MAX_BODY_BYTES = 10 * 1024 * 1024

Scope = dict[str, Any]
ASGIApp = Callable[
    [Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]
]

# Jan's exact 401 body on the OpenAI routes.
JAN_UNAUTHORIZED = {
    "error": {"message": "Unauthorized", "type": "authentication_error", "code": "unauthorized"}
}


def error_body(path: str, err: ServerError) -> dict[str, Any]:
    """The protocol's own error envelope: Anthropic's on /v1/messages, OpenAI's elsewhere."""
    if path.startswith("/v1/messages"):
        kind = (
            err.kind
            if err.kind != "invalid_request_error" or err.status == 400
            else "invalid_request_error"
        )
        return {
            "type": "error",
            "error": {"type": kind, "message": err.message},
            "request_id": None,
        }
    if isinstance(err, AuthenticationFailed):
        return JAN_UNAUTHORIZED
    kind = {"overloaded_error": "server_error", "api_error": "server_error"}.get(err.kind, err.kind)
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}


async def send_json(
    send: Callable[[Any], Awaitable[None]],
    status: int,
    body: dict[str, Any],
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    data = json.dumps(body).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": hdrs + (headers or [])})
    await send({"type": "http.response.body", "body": data})


class GuardMiddleware:
    """Rejects unauthenticated /v1 requests (401) and bodies over the size limit (413)."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str = "",
        max_body: int = MAX_BODY_BYTES,
        keyed_paths: frozenset[str] = frozenset(),
    ):
        self.app = app
        self.key = api_key.encode()
        self.max_body = max_body
        self.keyed_paths = keyed_paths  # besides /v1: paths that need the key too

    async def __call__(
        self,
        scope: Scope,
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        if b"%" in scope.get("raw_path", b""):
            # No route has an escaped character: "/v1/chat%2Fcompletions" must not reach
            # "/v1/chat/completions" once decoded.
            missing = NotFound(f"no route for {scope.get('method', '')} {path}")
            await send_json(send, 404, error_body(path, missing))
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        keyed = path.startswith("/v1") or path in self.keyed_paths
        if self.key and keyed and not self._authorized(headers):
            err = AuthenticationFailed(
                "invalid or missing API key (send Authorization: Bearer <key> or x-api-key)"
            )
            await send_json(send, 401, error_body(path, err))
            return
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            await send_json(send, 413, error_body(path, self._too_large()))
            return
        await self.app(scope, self._limited(receive), send)

    def _too_large(self) -> RequestTooLarge:
        return RequestTooLarge(f"request body is larger than {self.max_body // (1024 * 1024)} MiB")

    def _authorized(self, headers: dict[str, bytes]) -> bool:
        auth = headers.get("authorization", b"")
        bearer = auth[7:] if auth[:7].lower() == b"bearer " else b""
        xkey = headers.get("x-api-key", b"")
        # Compare both in constant time; never short-circuit on the first.
        ok_bearer = hmac.compare_digest(bearer, self.key)
        ok_xkey = hmac.compare_digest(xkey, self.key)
        return ok_bearer or ok_xkey

    def _limited(self, receive: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[Any]]:
        seen = 0

        async def wrapped() -> Any:
            nonlocal seen
            message = await receive()
            if message.get("type") == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise self._too_large()
            return message

        return wrapped
