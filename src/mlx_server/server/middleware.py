"""Pure ASGI middleware: API-key auth on /v1 and /api/ (Ollama's) routes and the
request-body size limit.

Written as raw ASGI (not BaseHTTPMiddleware) so streaming responses and client-disconnect
detection pass through untouched.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

from mlx_server.errors import AuthenticationFailed, NotFound, RequestTooLarge
from mlx_server.server.errors import Envelopes

MAX_BODY_BYTES = 10 * 1024 * 1024
# Paths under these need the key: OpenAI's and Anthropic's /v1, Ollama's /api/.
KEYED_PREFIXES = ("/v1", "/api/")

Scope = dict[str, Any]
ASGIApp = Callable[
    [Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]
]


class GuardMiddleware:
    """Rejects unauthenticated /v1 requests (401) and bodies over the size limit (413)."""

    def __init__(
        self,
        app: ASGIApp,
        envelopes: Envelopes,
        api_key: str = "",
        max_body: int = MAX_BODY_BYTES,
        keyed_paths: frozenset[str] = frozenset(),
    ):
        self.app = app
        self.envelopes = envelopes
        self.key = api_key.encode()
        self.max_body = max_body
        self.keyed_paths = keyed_paths  # besides KEYED_PREFIXES: paths that need the key too

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
            await self.envelopes.send(send, path, missing)
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        keyed = path.startswith(KEYED_PREFIXES) or path in self.keyed_paths
        if self.key and keyed and not self._authorized(headers):
            err = AuthenticationFailed(
                "invalid or missing API key (send Authorization: Bearer <key> or x-api-key)"
            )
            await self.envelopes.send(send, path, err)
            return
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            await self.envelopes.send(send, path, self._too_large())
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
