"""The HTTP side of the metrics: the middleware that counts requests by route, method and
status and clients gone before their response ended, and the ``GET /metrics`` page."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from mlx_server.server.metrics import Metrics

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]


class MetricsMiddleware:
    """Counts requests by route (a known path, else ``other``), method and status, and
    clients that disconnect before their response ends."""

    def __init__(self, app: Any, metrics: Metrics, routes: Callable[[], set[str]]):
        self.app = app
        self.metrics = metrics
        self.routes = routes
        self._known: set[str] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._known is None:
            self._known = self.routes()
        path = scope.get("path", "")
        route = path if path in self._known else "other"
        method = scope.get("method", "")
        state = {"started": False, "complete": False, "gone": False}

        async def watched_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                # Counted as the answer starts, so a client that reads it sees it counted.
                state["started"] = True
                matched = getattr(scope.get("route"), "path", None) or route
                self.metrics.requests.labels(matched, method, str(message["status"])).inc()
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                state["complete"] = True
            await send(message)

        async def watched_receive() -> Any:
            message = await receive()
            if message["type"] == "http.disconnect" and not state["complete"]:
                if not state["gone"]:
                    state["gone"] = True
                    self.metrics.disconnects.inc()
            return message

        try:
            await self.app(scope, watched_receive, watched_send)
        finally:
            if not state["started"]:  # the app failed before answering
                self.metrics.requests.labels(route, method, "500").inc()


def route_paths(routes: Iterable[Any]) -> set[str]:
    """The paths of an app's routes, through included routers (which FastAPI may keep as
    wrappers around the original router)."""
    out: set[str] = set()
    for r in routes:
        path = getattr(r, "path", None)
        if isinstance(path, str) and path:
            out.add(path)
        inner = getattr(r, "original_router", None)
        if inner is not None:
            out |= route_paths(inner.routes)
    return out


def install_metrics(app: Any, metrics: Metrics) -> None:
    """Serve ``GET /metrics``; add ``MetricsMiddleware`` last (outermost) so refused
    requests are counted too."""

    @app.get("/metrics")
    async def metrics_page() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
