"""Top-level request fields the schema does not know: accepted (clients send vendor
extras), but never silently. Each is logged once per route (a warning line naming the field
and the route), and the response lists them in ``x-mlx-server-ignored-fields``, so a client
that sends ``max_token`` or ``top_K`` can see that they had no effect.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pydantic import BaseModel

from mlx_server.logs import log

HEADER = "x-mlx-server-ignored-fields"
STATE_KEY = "mlx_server_ignored_fields"
# Bounds against a body of a million distinct keys: the header names the first few, the
# log remembers a limited number of (route, field) pairs.
MAX_LISTED = 32
MAX_NAME = 64
MAX_REMEMBERED = 4096

_logged: set[tuple[str, str]] = set()
_lock = threading.Lock()


@functools.cache
def known_fields(schema: type[BaseModel]) -> frozenset[str]:
    """The top-level names a schema declares, aliases included."""
    names: set[str] = set()
    for name, info in schema.model_fields.items():
        names.add(name)
        if info.alias:
            names.add(info.alias)
    return frozenset(names)


def printable(name: str) -> str:
    """A field name as it can go into a header and a log line (escaped, cut short)."""
    safe = name.encode("unicode_escape").decode("ascii").replace(",", "\\x2c")
    return safe if len(safe) <= MAX_NAME else safe[: MAX_NAME - 3] + "..."


def note_ignored(
    scope: MutableMapping[str, Any], body: dict[str, Any], schema: type[BaseModel]
) -> list[str]:
    """Record the body's unknown top-level fields on the request (for the header) and log
    the ones not logged before on this route; returns them, sorted."""
    known = known_fields(schema)
    ignored = sorted(printable(k) for k in body if k not in known)[:MAX_LISTED]
    if not ignored:
        return []
    scope.setdefault("state", {})[STATE_KEY] = ignored
    route = f"{scope.get('method', 'POST')} {scope.get('path', '')}"
    with _lock:
        new = [k for k in ignored if (route, k) not in _logged]
        if len(_logged) < MAX_REMEMBERED:
            _logged.update((route, k) for k in new)
    for k in new:
        log(f"Warning: unknown field '{k}' on {route} was ignored (it has no effect)")
    return ignored


Scope = dict[str, Any]
Send = Callable[[Any], Awaitable[None]]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Send], Awaitable[None]]


class IgnoredFieldsHeader:
    """Pure ASGI middleware adding ``x-mlx-server-ignored-fields`` to a response whose
    request had unknown fields (the body is read, and the fields noted, before the
    response starts; streams pass through untouched)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(
        self, scope: Scope, receive: Callable[[], Awaitable[Any]], send: Send
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Any) -> None:
            if message.get("type") == "http.response.start":
                ignored = scope.get("state", {}).get(STATE_KEY)
                if ignored:
                    headers = list(message.get("headers", []))
                    headers.append((HEADER.encode(), ", ".join(ignored).encode("ascii")))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_header)
