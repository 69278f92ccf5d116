"""Every OpenAI route also answers without its ``/v1`` prefix (``/models``,
``/chat/completions``, ``/completions``, ``/responses/{id}``, any ``/v1`` route added later),
as mlx-vlm and llama-server do: clients configured with a base URL without ``/v1`` work.

The alias rewrites the path before anything else sees the request, so auth, the browser
guard, the size limit, metrics and the error envelope treat it exactly as the original.
Paths that are routes of their own (``/health``, ``/tokenize``) are left alone, and so is
Anthropic's ``/v1/messages``, whose clients always send the prefix.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from starlette.routing import BaseRoute, Match

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]

PREFIX = "/v1"
NOT_ALIASED = ("/v1/messages",)


class OpenAIPathAliases:
    """Raw ASGI: ``/x`` becomes ``/v1/x`` when that is a route and ``/x`` is not."""

    def __init__(self, app: ASGIApp, routes: Callable[[], Sequence[BaseRoute]]):
        self.app = app
        self.routes = routes  # read per request: routes added after start are aliased too

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope = self.aliased(scope)
        await self.app(scope, receive, send)

    def aliased(self, scope: Scope) -> Scope:
        path: str = scope.get("path", "")
        if path == PREFIX or path.startswith(PREFIX + "/") or self._routed(scope):
            return scope
        target = PREFIX + path
        if target.startswith(NOT_ALIASED):
            return scope
        rewritten = {
            **scope,
            "path": target,
            "raw_path": PREFIX.encode() + scope.get("raw_path", path.encode()),
        }
        return rewritten if self._routed(rewritten) else scope

    def _routed(self, scope: Scope) -> bool:
        """Whether some route takes this path (with any method: a wrong one gets its 405)."""
        return any(route.matches(scope)[0] is not Match.NONE for route in self.routes())
