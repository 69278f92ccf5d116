"""``/api/embed`` (a list of inputs, ``embeddings``) and the older ``/api/embeddings`` (one
``prompt``, ``embedding``) over an embedding model's service."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from mlx_server.embedding_service import EmbeddingService
from mlx_server.registry.lease import Models
from mlx_server.server.collect import collect

from .schemas import EmbedBody, EmbeddingsBody


def make_router(models: Models) -> APIRouter:
    """The embedding routes (a chat model named, or the only one served: a 400 naming it)."""
    router = APIRouter()

    @router.post("/api/embed")
    async def embed(request: Request) -> Response:
        return await _answer(request, EmbedBody, _embed)

    @router.post("/api/embeddings")
    async def embeddings(request: Request) -> Response:
        return await _answer(request, EmbeddingsBody, _embeddings)

    async def _answer(
        request: Request,
        schema: type[EmbedBody] | type[EmbeddingsBody],
        answer: Callable[[Any, EmbeddingService, int], Awaitable[dict[str, Any]]],
    ) -> Response:
        arrived = time.perf_counter_ns()
        return await collect(
            request, schema, models.encoder, lambda body, service: answer(body, service, arrived)
        )

    return router


async def _embed(body: EmbedBody, service: EmbeddingService, arrived: int) -> dict[str, Any]:
    inputs = [body.input] if isinstance(body.input, str) else list(body.input)
    loaded = time.perf_counter_ns()
    done = await service.embed(inputs, truncate=body.truncate, dimensions=body.dimensions)
    return {
        "model": body.model,
        "embeddings": [[float(x) for x in v] for v in done.vectors],
        "total_duration": time.perf_counter_ns() - arrived,
        "load_duration": loaded - arrived,
        "prompt_eval_count": done.prompt_tokens,
    }


async def _embeddings(
    body: EmbeddingsBody, service: EmbeddingService, arrived: int
) -> dict[str, Any]:
    if not body.prompt:  # Ollama answers an empty prompt with an empty vector
        return {"embedding": []}
    done = await service.embed([body.prompt], truncate=True, dimensions=None)
    return {"embedding": [float(x) for x in done.vectors[0]]}
