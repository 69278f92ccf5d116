"""What a request leaves to run once its response has ended: a stream's last byte sent, a
collected answer written, an error answered, or the client gone. A route that leases a model
for its request gives the lease back this way, so a model is never unloaded under a stream
that is still being written."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Request

_KEY = "mlx_server.after_response"


def after_response(request: Request, fn: Callable[[], None]) -> None:
    """Run ``fn`` once ``request``'s response has ended, however it ended."""
    request.scope[_KEY].append(fn)


class AfterResponse:
    """Raw ASGI middleware: runs what each request left with ``after_response``, last first,
    after the app has answered it (streams included)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        left: list[Callable[[], None]] = []
        scope[_KEY] = left
        try:
            await self.app(scope, receive, send)
        finally:
            for fn in reversed(left):
                fn()
