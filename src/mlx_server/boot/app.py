"""The app factory: wires the protocols' routes and error envelopes onto the server's
plumbing (middleware, browser guard, metrics, error handlers) around the models served: one
chat model, one embedding or reranker model (whose app answers the chat routes with a 400
that says which model this is and what it serves), or a registry's. One plumbing stack for
all; every router is handed the ``Models`` its requests lease from and its settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from mlx_server.config import Settings
from mlx_server.embedding_service import EmbeddingService
from mlx_server.errors import InvalidRequest, article
from mlx_server.logs import log
from mlx_server.protocols.anthropic import errors as anthropic_errors
from mlx_server.protocols.anthropic.routes import make_router as anthropic_router
from mlx_server.protocols.llamacpp import make_router as tokenizer_router
from mlx_server.protocols.ollama import errors as ollama_errors
from mlx_server.protocols.ollama.embed import make_router as ollama_embed_router
from mlx_server.protocols.ollama.routes import listing_router as ollama_listing_router
from mlx_server.protocols.ollama.routes import make_router as ollama_router
from mlx_server.protocols.openai import errors as openai_errors
from mlx_server.protocols.openai.chat.routes import make_router as chat_router
from mlx_server.protocols.openai.completions.routes import make_router as completions_router
from mlx_server.protocols.openai.embeddings.routes import embeddings_router, rerank_router
from mlx_server.protocols.openai.model_list import make_router as model_list_router
from mlx_server.protocols.responses.routes import make_router as responses_router
from mlx_server.protocols.responses.store import ResponseStore
from mlx_server.registry.lease import Models, OneModel
from mlx_server.server.after_response import AfterResponse
from mlx_server.server.aliases import OpenAIPathAliases
from mlx_server.server.browser_guard import BrowserGuard, BrowserPolicy
from mlx_server.server.errors import Envelopes, install_error_handlers
from mlx_server.server.http import parse_body
from mlx_server.server.ignored_fields import IgnoredFieldsHeader
from mlx_server.server.metrics import Metrics
from mlx_server.server.metrics_http import MetricsMiddleware, install_metrics, route_paths
from mlx_server.server.middleware import MAX_BODY_BYTES, GuardMiddleware
from mlx_server.server.streaming import KEEPALIVE_S
from mlx_server.service import ChatService
from mlx_server.webui import make_router as webui_router


class CancelRequest(BaseModel):
    id: str | None = None


# The generating routes of a chat model, refused with a 400 (not a 404) by an embedding model.
CHAT_PATHS = (
    "/v1/chat/completions",
    "/v1/chat/completions/count_tokens",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/tokenize",
    "/detokenize",
    "/api/chat",
    "/api/generate",
)
# Besides every /v1 path: the paths that need the API key too.
KEYED_PATHS = frozenset({"/tokenize", "/detokenize", "/embeddings", "/rerank"})


def create_app(
    served: ChatService | EmbeddingService | Models,
    *,
    api_key: str = "",
    vision: bool = False,
    max_body: int = MAX_BODY_BYTES,
    browser: BrowserPolicy | None = None,
    metrics_open: bool = False,
    responses_store: ResponseStore | None = None,
    webui: bool = True,
    max_n: int = Settings.max_n,
    max_queue: int = Settings.max_queue,
    keepalive_s: float = KEEPALIVE_S,
    extra: APIRouter | None = None,
    metrics: Metrics | None = None,
) -> FastAPI:
    """Build the ASGI app around one model's service (a ChatService, whose engine may be
    real or scripted, or an EmbeddingService) or a registry's ``Models``. ``max_n``: the
    most choices per request; ``max_queue``: the requests an engine lets wait (a batch of
    prompts asking for more is a 400); ``keepalive_s``: how long a stream may stay silent before it
    gets a keep-alive frame; ``extra``: routes matched before the ones below (a registry's
    load and unload); ``metrics``: what the engines were built to report their generations
    to (a new one, counting only HTTP, when not given)."""
    models = OneModel(served) if isinstance(served, ChatService | EmbeddingService) else served
    app = FastAPI(title="mlx-server", docs_url=None, redoc_url=None, openapi_url=None)
    # Paths match exactly: no redirect from "/v1/chat/completions/" to the route.
    app.router.redirect_slashes = False
    metrics = metrics or Metrics()
    metrics.count(models.counters())
    install_metrics(app, metrics)
    if extra is not None:
        app.include_router(extra)
    if isinstance(served, EmbeddingService):
        _embedding_routes(app, served, models)
    else:
        store = responses_store if responses_store is not None else ResponseStore()
        settings = _RouteSettings(vision, max_n, max_queue, keepalive_s)
        _chat_routes(app, models, settings, store=store, webui=webui)
    envelopes = error_envelopes()
    install_error_handlers(app, envelopes)
    keyed = KEYED_PATHS if metrics_open else KEYED_PATHS | {"/metrics"}
    app.add_middleware(AfterResponse)  # gives back the models the request leased
    app.add_middleware(IgnoredFieldsHeader)
    app.add_middleware(
        GuardMiddleware, envelopes=envelopes, api_key=api_key, max_body=max_body, keyed_paths=keyed
    )
    # Outside auth: preflights carry no key.
    app.add_middleware(BrowserGuard, envelopes=envelopes, policy=browser)
    app.add_middleware(
        MetricsMiddleware,
        metrics=metrics,
        routes=lambda: route_paths(app.routes),
    )
    app.add_middleware(OpenAIPathAliases, routes=lambda: app.router.routes)  # outermost
    return app


@dataclass(frozen=True)
class _RouteSettings:
    vision: bool  # media parts are taken (a model that takes images is served)
    max_n: int
    max_queue: int
    keepalive_s: float


def _chat_routes(
    app: FastAPI, models: Models, s: _RouteSettings, *, store: ResponseStore, webui: bool
) -> None:
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Any:
        body = models.health()
        if body.get("status") == "error":  # the model cannot serve (its reason in the body)
            return JSONResponse(body, status_code=503)
        return body

    @app.post("/v1/cancel")
    async def cancel(request: Request) -> dict[str, Any]:
        raw = await request.body()
        target = None
        if raw.strip():
            target = (await parse_body(request, CancelRequest)).id
        n = sum(engine.cancel(target) for engine in models.engines())
        log(f"Cancel requested: {n} active generation(s) cancelled")
        return {"status": "cancelled" if n else "no_active_generation", "cancelled_count": n}

    keepalive_s = s.keepalive_s
    app.include_router(model_list_router(models))
    app.include_router(chat_router(models, vision=s.vision, max_n=s.max_n, keepalive_s=keepalive_s))
    app.include_router(anthropic_router(models, vision=s.vision, keepalive_s=keepalive_s))
    app.include_router(
        completions_router(models, max_n=s.max_n, keepalive_s=keepalive_s, max_queue=s.max_queue)
    )
    app.include_router(tokenizer_router(models))
    app.include_router(
        responses_router(models, vision=s.vision, store=store, keepalive_s=keepalive_s)
    )
    app.include_router(embeddings_router(models))  # a chat model: 400s
    app.include_router(rerank_router(models))
    app.include_router(ollama_router(models, vision=s.vision, keepalive_s=keepalive_s))
    if webui:  # the chat page at / (static files; it uses the API above like any client)
        app.include_router(webui_router())


def _embedding_routes(app: FastAPI, service: EmbeddingService, models: Models) -> None:
    @app.get("/health")
    async def health() -> dict[str, Any]:
        return models.health()

    @app.post("/v1/cancel")
    async def cancel() -> dict[str, Any]:
        return {"status": "no_active_generation", "cancelled_count": 0}

    async def refuse(request: Request) -> None:
        serves = "/v1/rerank" if service.kind == "rerank" else "/v1/embeddings"
        raise InvalidRequest(
            f"the model '{service.model_id}' is {article(service.kind)} {service.kind} model; "
            f"it serves {serves}, not {request.url.path}",
            param="model",
            code="model_not_supported",
        )

    for path in CHAT_PATHS:
        app.add_api_route(path, refuse, methods=["POST"])
    app.include_router(model_list_router(models))
    app.include_router(embeddings_router(models))
    app.include_router(rerank_router(models))
    app.include_router(ollama_embed_router(models))
    app.include_router(ollama_listing_router(models))


def app_options(settings: Settings, *, vision: bool = False) -> dict[str, Any]:
    """``create_app``'s keyword arguments for these settings; ``vision``: a model that takes
    images is served (the body limit makes room for one)."""
    max_body = MAX_BODY_BYTES
    if vision:  # room for at least one base64 image of the largest size allowed
        max_body = max(max_body, int(settings.max_image_mb * (1 << 20) * 4 / 3) + (1 << 20))
    browser = BrowserPolicy.from_flags(
        settings.host, settings.allowed_hosts, settings.allowed_origins
    )
    store = ResponseStore(
        settings.responses_store_size, int(settings.responses_store_mb * (1 << 20))
    )
    return {
        "api_key": settings.api_key,
        "vision": vision,
        "max_body": max_body,
        "browser": browser,
        "metrics_open": settings.metrics_open,
        "responses_store": store,
        "webui": not settings.no_webui,
        "max_n": settings.max_n,
        "max_queue": settings.max_queue,
    }


def error_envelopes() -> Envelopes:
    """OpenAI's envelope everywhere but on the paths a protocol claims for its own."""
    envelopes = Envelopes(openai_errors.error_response)
    for prefix in anthropic_errors.PATHS:
        envelopes.register(prefix, anthropic_errors.error_response)
    for prefix in ollama_errors.PATHS:
        envelopes.register(prefix, ollama_errors.error_response)
    return envelopes
