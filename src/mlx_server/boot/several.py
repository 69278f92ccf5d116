"""Several-models start-up: the catalog, the registry and the app whose routes lease from it."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

from mlx_server.boot.app import app_options, create_app
from mlx_server.boot.chat import load_chat_model
from mlx_server.boot.embedding import load_embedding_model
from mlx_server.boot.memory import kv_budget_bytes, set_cache_limit
from mlx_server.config import Settings
from mlx_server.logs import log
from mlx_server.models.loader import device_memory_bytes
from mlx_server.registry.catalog import Offer, discover
from mlx_server.registry.lease import RegistryModels
from mlx_server.registry.registry import Limits, ModelRegistry
from mlx_server.registry.routes import ModelsCollector, make_router
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


def build(settings: Settings) -> tuple[Any, ModelRegistry]:
    """The app over every offered model (pinned ones loaded now) and the registry (which
    stops every loaded model's engine at shutdown)."""
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
    vision = any(o.kind == "vision" for o in offers)
    options = app_options(settings, vision=vision)
    models = RegistryModels(registry, settings.ctx_size)
    app = create_app(models, **options, extra=make_router(registry), metrics=metrics)
    metrics.registry.register(ModelsCollector(registry))
    for model_id in settings.pinned:  # loaded before the server reports ready
        asyncio.run(registry.load(model_id))
    return app, registry
