"""The app factory: wires the service and engine into routes, middleware and error handlers."""

from __future__ import annotations

import traceback
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from mlx_server.choices import DEFAULT_MAX_N
from mlx_server.errors import InvalidRequest, MethodNotAllowed, NotFound, Overloaded, ServerError
from mlx_server.logs import log
from mlx_server.protocols.anthropic.routes import make_router as anthropic_router
from mlx_server.protocols.llamacpp import make_router as tokenizer_router
from mlx_server.protocols.openai.completions import make_router as completions_router
from mlx_server.protocols.openai.count_tokens import make_router as count_tokens_router
from mlx_server.protocols.openai.routes import make_router as openai_router
from mlx_server.protocols.responses.routes import make_router as responses_router
from mlx_server.protocols.responses.store import ResponseStore
from mlx_server.server.browser_guard import BrowserGuard, BrowserPolicy
from mlx_server.server.errors import json_error
from mlx_server.server.http import parse_body
from mlx_server.server.ignored_fields import IgnoredFieldsHeader
from mlx_server.server.metrics import MetricsMiddleware, install_metrics, route_paths
from mlx_server.server.middleware import MAX_BODY_BYTES, GuardMiddleware
from mlx_server.service import ChatService
from mlx_server.webui import make_router as webui_router


class CancelRequest(BaseModel):
    id: str | None = None


_HEALTH_STATS = ("prompt_cache_", "kv_in_use_bytes", "memory_")


def create_app(
    service: ChatService,
    *,
    api_key: str = "",
    vision: bool = False,
    max_body: int = MAX_BODY_BYTES,
    browser: BrowserPolicy | None = None,
    metrics_open: bool = False,
    responses_store: ResponseStore | None = None,
    webui: bool = True,
    max_n: int = DEFAULT_MAX_N,
) -> FastAPI:
    """Build the ASGI app around a ChatService (whose engine may be real or scripted)."""
    app = FastAPI(title="mlx-server", docs_url=None, redoc_url=None, openapi_url=None)
    # Paths match exactly: no redirect from "/v1/chat/completions/" to the route.
    app.router.redirect_slashes = False
    app.state.service = service
    app.state.max_n = max_n  # most choices (n) per request
    app.state.metrics = metrics = install_metrics(app, service)
    engine = service.engine

    @app.get("/health")
    async def health() -> dict[str, Any]:
        body = {"status": "ok", "active": engine.active_count, "queued": engine.queue_depth}
        stats = getattr(engine, "stats", None)
        if stats is not None:  # prefix-cache counters (RAM and disk tiers), memory in use
            body.update({k: v for k, v in stats().items() if k.startswith(_HEALTH_STATS)})
        return body

    @app.post("/v1/cancel")
    async def cancel(request: Request) -> dict[str, Any]:
        raw = await request.body()
        target = None
        if raw.strip():
            target = (await parse_body(request, CancelRequest)).id
        n = engine.cancel(target)
        log(f"Cancel requested: {n} active generation(s) cancelled")
        return {"status": "cancelled" if n else "no_active_generation", "cancelled_count": n}

    app.include_router(openai_router(service, vision=vision))
    app.include_router(anthropic_router(service, vision=vision))
    app.include_router(completions_router(service))
    app.include_router(count_tokens_router(service, vision=vision))
    app.include_router(tokenizer_router(service))
    app.include_router(responses_router(service, vision=vision, store=responses_store))
    if webui:  # the chat page at / (static files; it uses the API above like any client)
        app.include_router(webui_router())

    _install_error_handlers(app)
    keyed = frozenset({"/tokenize", "/detokenize"} | (set() if metrics_open else {"/metrics"}))
    app.add_middleware(IgnoredFieldsHeader)
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body=max_body, keyed_paths=keyed)
    app.add_middleware(BrowserGuard, policy=browser)  # outside auth: preflights carry no key
    app.add_middleware(
        MetricsMiddleware,
        metrics=metrics,
        routes=lambda: route_paths(app.routes),
    )
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServerError)
    async def on_server_error(request: Request, exc: ServerError) -> JSONResponse:
        if exc.status >= 500 and not isinstance(exc, Overloaded):
            log(f"Error processing request: {exc.message}")
        return json_error(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Query parameters (e.g. /v1/responses/{id}/input_items?limit=x); bodies are
        # validated by parse_body.
        return json_error(request.url.path, InvalidRequest(f"invalid request: {exc.errors()}"))

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
        return json_error(request.url.path, err)

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
        return json_error(request.url.path, err, {"Connection": "close"})
