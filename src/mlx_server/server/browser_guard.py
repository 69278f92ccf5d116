"""A browser-safe localhost: Host and Origin checks, CORS, and JSON-only POST bodies.

The server listens on localhost for the user's own apps, but every web page the user opens
can send requests to localhost too. Three rules keep pages out while desktop clients (Jan
sends ``Origin: tauri://localhost``; SDKs, curl and editors send no Origin) work unchanged:

- **Host** must name a loopback address or the bound address (or one allowed with
  ``--allowed-hosts``): a page that rebinds its own DNS name to 127.0.0.1 (DNS rebinding)
  sends its own name as Host and gets 403, so it can neither read answers nor make the
  server work. An IP literal cannot be rebound, so with a wildcard bind any IP is accepted.
- **Origin**, when present (browsers send it on every POST and every CORS request),
  must be allowed: by default Tauri's origins and http(s) pages on localhost. Others get
  403 before any work is done, and no CORS headers, so the browser hides every answer.
- a **POST with an Origin** must carry a JSON body (``Content-Type: application/json``),
  or it gets 415: forms and ``text/plain`` "simple requests" skip the CORS preflight.
  Requests without an Origin do not come from a web page, so ``curl -d '{...}'`` (which
  sends a form content type) keeps working.

Written as raw ASGI so streaming responses pass through untouched.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from mlx_server.errors import Forbidden, UnsupportedMediaType
from mlx_server.server.errors import Envelopes
from mlx_server.server.ignored_fields import HEADER as IGNORED_FIELDS_HEADER

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]

TAURI_ORIGINS = ("tauri://localhost", "http://tauri.localhost", "https://tauri.localhost")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
ALLOW_METHODS = "GET, POST, OPTIONS"
# Response headers of this server's own that a page may read (CORS hides all but a few).
EXPOSE_HEADERS = IGNORED_FIELDS_HEADER
ALLOW_HEADERS = (
    "authorization, content-type, x-api-key, anthropic-version, anthropic-beta, "
    "anthropic-dangerous-direct-browser-access, openai-organization, openai-project"
)
WILDCARD_BINDS = ("0.0.0.0", "::", "")


def _split_list(value: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    return tuple(x.strip().lower().rstrip("/") for x in items if x.strip())


def host_name(host_header: str) -> str:
    """``Host`` without its port, lowercased: ``[::1]:8080`` → ``::1``."""
    h = host_header.strip().lower()
    if h.startswith("["):
        return h[1 : h.find("]")] if "]" in h else h
    if h.count(":") == 1:
        h = h.split(":", 1)[0]
    return h.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _is_loopback(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):
        return True  # browsers resolve *.localhost to loopback themselves (RFC 6761)
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class BrowserPolicy:
    """Which Host names and Origins the server answers. ``"*"`` in a list allows any."""

    bound_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()

    @classmethod
    def from_flags(cls, bound_host: str, hosts: str, origins: str) -> BrowserPolicy:
        return cls(bound_host.lower(), _split_list(hosts), _split_list(origins))

    def host_allowed(self, host_header: str | None) -> bool:
        if host_header is None or "*" in self.allowed_hosts:
            return True  # no Host at all: an HTTP/1.0 client, not a browser
        name = host_name(host_header)
        if _is_loopback(name) or name in self.allowed_hosts:
            return True
        if name == host_name(self.bound_host) and self.bound_host not in WILDCARD_BINDS:
            return True
        # An IP literal cannot be rebound; with a wildcard bind any local IP may be used.
        return self.bound_host in WILDCARD_BINDS and _is_ip(name)

    def origin_allowed(self, origin: str) -> bool:
        o = origin.strip().lower().rstrip("/")
        if "*" in self.allowed_origins or o in self.allowed_origins or o in TAURI_ORIGINS:
            return True
        try:
            parts = urlsplit(o)
            port_ok = parts.port is None or parts.port > 0
        except ValueError:
            return False
        return parts.scheme in ("http", "https") and parts.hostname in LOOPBACK_NAMES and port_ok


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


class BrowserGuard:
    """Enforces a BrowserPolicy; answers CORS preflights; adds CORS headers for allowed
    origins. Errors use the route's protocol envelope."""

    def __init__(self, app: Any, envelopes: Envelopes, policy: BrowserPolicy | None = None):
        self.app = app
        self.envelopes = envelopes
        self.policy = policy or BrowserPolicy()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host")
        if not self.policy.host_allowed(host):
            err = Forbidden(
                f"Host '{host}' is not allowed: this server answers requests for localhost; "
                "start it with --allowed-hosts to add names"
            )
            await self.envelopes.send(send, path, err)
            return
        origin = headers.get("origin")
        if origin is None:
            await self.app(scope, receive, send)
            return
        if not self.policy.origin_allowed(origin):
            err = Forbidden(
                f"Origin '{origin}' is not allowed: web pages may not use this server; start "
                "it with --allowed-origins to allow a page"
            )
            await self.envelopes.send(send, path, err)
            return
        cors = [(b"access-control-allow-origin", origin.encode()), (b"vary", b"Origin")]
        method = scope.get("method", "")
        if method == "OPTIONS" and "access-control-request-method" in headers:
            await self._preflight(send, headers, cors)
            return
        if method == "POST" and not _is_json(headers.get("content-type", "")):
            if "content-type" in headers or _has_body(headers):
                ctype = headers.get("content-type", "none")
                refused = UnsupportedMediaType(
                    f"a request from a web page must send a JSON body with Content-Type: "
                    f"application/json (got {ctype})"
                )
                await self.envelopes.send(send, path, refused, cors)
                return
        expose = (b"access-control-expose-headers", EXPOSE_HEADERS.encode())
        await self.app(scope, receive, _with_headers(send, [*cors, expose]))

    async def _preflight(
        self, send: Send, headers: dict[str, str], cors: list[tuple[bytes, bytes]]
    ) -> None:
        requested = headers.get("access-control-request-headers", "")
        allow = ALLOW_HEADERS + (f", {requested}" if requested else "")
        out = [
            *cors,
            (b"access-control-allow-methods", ALLOW_METHODS.encode()),
            (b"access-control-allow-headers", allow.encode("latin-1")),
            (b"access-control-max-age", b"600"),
            (b"content-length", b"0"),
        ]
        if headers.get("access-control-request-private-network") == "true":
            out.append((b"access-control-allow-private-network", b"true"))
        await send({"type": "http.response.start", "status": 204, "headers": out})
        await send({"type": "http.response.body", "body": b""})


def _has_body(headers: dict[str, str]) -> bool:
    length = headers.get("content-length", "0").strip()
    return "transfer-encoding" in headers or (length.isdigit() and int(length) > 0)


def _with_headers(send: Send, extra: list[tuple[bytes, bytes]]) -> Send:
    async def wrapped(message: Any) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return wrapped
