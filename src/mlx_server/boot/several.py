"""Several-models start-up: the catalog, the registry, the routing service and the app."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any, cast

from fastapi import APIRouter

from mlx_server.boot.app import app_options, create_app
from mlx_server.boot.chat import load_chat_model
from mlx_server.boot.embedding import load_embedding_model
from mlx_server.boot.memory import kv_budget_bytes, set_cache_limit
from mlx_server.config import Settings
from mlx_server.logs import log
from mlx_server.models.loader import device_memory_bytes
from mlx_server.protocols.ollama.embed import make_router as ollama_embed_router
from mlx_server.protocols.openai.embeddings import make_router as embeddings_router
from mlx_server.protocols.openai.rerank import make_router as rerank_router
from mlx_server.registry.catalog import Offer, discover
from mlx_server.registry.registry import Limits, ModelRegistry
from mlx_server.registry.routes import ModelsCollector, make_router
from mlx_server.registry.routing import RequestLeases, RoutedEmbeddings, RoutedService, binder
from mlx_server.server.metrics import Metrics


def limits(settings: Settings) -> Limits:
    memory = settings.models_memory_gb
    kv_bytes = kv_budget_bytes(settings)
    return Limits(
        memory_bytes=int(memory * (1 << 30)) if memory is not None else device_memory_bytes(),
        max_loaded=settings.models_max,
        idle_s=settings.idle_unload_s,
        max_waiting=max(1, settings.max_queue),
        # The KV budget holds the prefix cache's RAM tier too (engine/core/memory.py).
        overhead_bytes=kv_bytes,
    )


def build(settings: Settings) -> tuple[Any, Any]:
    """The app over every offered model (pinned ones loaded now) and its routing engine."""
    offers = discover(settings)
    if not offers:
        raise ValueError(f"no models found in {settings.models_dir}")
    unknown = [p for p in settings.pinned if p not in {o.id for o in offers}]
    if unknown:
        raise ValueError(f"--pin: no offered model {', '.join(unknown)}")
    for o in offers:
        log(f"Offered model: {o.id} ({o.kind}, {o.path})")
    set_cache_limit(settings)
    metrics = Metrics()

    # Each model's KV budget is its share of the memory the registry sets aside (limits()),
    # not what one model alone would leave of the device.
    kv_gb = limits(settings).overhead_bytes / (1 << 30)

    def load(offer: Offer) -> Any:
        one = dataclasses.replace(settings, model=offer.path, model_id=offer.id, kv_budget_gb=kv_gb)
        if offer.kind == "embedding":
            return load_embedding_model(one, Path(offer.path))
        return load_chat_model(one, observer=metrics)  # every model's generations counted

    registry = ModelRegistry(offers, limits(settings), load, pinned=tuple(settings.pinned))
    service = RoutedService(registry)
    vision = any(o.kind == "vision" for o in offers)
    extra = routes(registry, settings.ctx_size)
    options = app_options(settings, vision=vision)
    app = create_app(cast(Any, service), **options, extra=extra, metrics=metrics)
    metrics.registry.register(ModelsCollector(registry))
    app.state.bind_model = binder(registry)
    app.state.registry = registry
    app.add_middleware(RequestLeases, registry=registry)
    for model_id in settings.pinned:  # loaded before the server reports ready
        asyncio.run(registry.load(model_id))
    return app, service.engine


def routes(registry: ModelRegistry, ctx_size: int) -> Any:
    """The registry's own routes, and the embeddings and rerank routes over its embedding
    models (matched before the chat app's, which answer a 400 for one chat model)."""
    router = APIRouter()
    router.include_router(make_router(registry, ctx_size))
    encoders = cast(Any, RoutedEmbeddings(registry))  # an EmbeddingService per request
    router.include_router(embeddings_router(encoders, registry.default_id))
    router.include_router(rerank_router(encoders, registry.default_id))
    router.include_router(ollama_embed_router(encoders, registry.default_id))
    return router
