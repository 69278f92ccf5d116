"""The app for an embedding or reranker model: the embeddings and rerank routes behind the
same auth, browser guard, metrics and error envelopes as the chat app; the chat routes
answer a 400 that says which model this is and what it serves."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from mlx_server.embedding_service import EmbeddingService
from mlx_server.errors import InvalidRequest
from mlx_server.protocols.ollama.embed import make_router as ollama_embed_router
from mlx_server.protocols.openai.embeddings import make_router as embeddings_router
from mlx_server.protocols.openai.model_list import model_object
from mlx_server.protocols.openai.rerank import make_router as rerank_router
from mlx_server.server.browser_guard import BrowserGuard, BrowserPolicy
from mlx_server.server.errors import install_error_handlers
from mlx_server.server.metrics import MetricsMiddleware, install_metrics, route_paths
from mlx_server.server.middleware import MAX_BODY_BYTES, GuardMiddleware

# The generating routes of the chat app, refused here with a 400 rather than a 404.
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


def create_embedding_app(
    service: EmbeddingService,
    *,
    api_key: str = "",
    max_body: int = MAX_BODY_BYTES,
    browser: BrowserPolicy | None = None,
    metrics_open: bool = False,
) -> FastAPI:
    app = FastAPI(title="mlx-server", docs_url=None, redoc_url=None, openapi_url=None)
    app.router.redirect_slashes = False
    app.state.service = service
    app.state.metrics = metrics = install_metrics(app, service)
    engine = service.engine

    @app.get("/health")
    async def health() -> dict[str, Any]:
        # The engine's counters too: inputs waiting, and inputs, tokens and batches done.
        stats = {k: v for k, v in engine.stats().items() if isinstance(v, int)}
        return {
            "status": "ok",
            **stats,
            "active": engine.active_count,
            "queued": engine.queue_depth,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        entry = model_object(service.model_id, capabilities=service.capabilities)
        return {"object": "list", "data": [entry]}

    @app.post("/v1/cancel")
    async def cancel() -> dict[str, Any]:
        return {"status": "no_active_generation", "cancelled_count": 0}

    async def refuse(request: Request) -> None:
        serves = "/v1/rerank" if service.kind == "rerank" else "/v1/embeddings"
        raise InvalidRequest(
            f"the model '{service.model_id}' is {_article(service.kind)} {service.kind} model; "
            f"it serves {serves}, not {request.url.path}",
            param="model",
            code="model_not_supported",
        )

    for path in CHAT_PATHS:
        app.add_api_route(path, refuse, methods=["POST"])
    app.include_router(embeddings_router(service, service.model_id))
    app.include_router(rerank_router(service, service.model_id))
    app.include_router(ollama_embed_router(service, service.model_id))

    from mlx_server.app import error_envelopes

    envelopes = error_envelopes()
    install_error_handlers(app, envelopes)
    keyed = frozenset(
        {"/tokenize", "/detokenize", "/embeddings", "/rerank"}
        | (set() if metrics_open else {"/metrics"})
    )
    app.add_middleware(
        GuardMiddleware, envelopes=envelopes, api_key=api_key, max_body=max_body, keyed_paths=keyed
    )
    app.add_middleware(BrowserGuard, envelopes=envelopes, policy=browser)
    app.add_middleware(MetricsMiddleware, metrics=metrics, routes=lambda: route_paths(app.routes))
    return app


def _article(kind: str) -> str:
    return "an" if kind[0] in "aeiou" else "a"
