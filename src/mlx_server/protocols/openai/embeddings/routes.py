"""The routes an embedding or reranker model serves: ``/v1/embeddings`` (and ``/embeddings``)
and ``/v1/rerank`` (and ``/rerank``). Each parses its body, leases the model it names (a
chat model is a 400 that says so) and collects the answer unless the client leaves first."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response

from mlx_server.embedding_service import EmbeddingService
from mlx_server.protocols.openai.embeddings.encoder import embeddings_json, rerank_json
from mlx_server.protocols.openai.embeddings.schemas import (
    EmbeddingRequest,
    EncoderBody,
    RerankRequest,
)
from mlx_server.registry.lease import Models
from mlx_server.server.collect import collect
from mlx_server.server.http import Lease

Body = TypeVar("Body", bound=EncoderBody)
# The body's JSON answer from the service (raising what refuses the body).
Answer = Callable[[Body, EmbeddingService], Awaitable[dict[str, Any]]]


def embeddings_router(models: Models) -> APIRouter:
    paths = ("/v1/embeddings", "/embeddings")
    return _router(paths, EmbeddingRequest, _embed, models.encoder)


def rerank_router(models: Models) -> APIRouter:
    return _router(("/v1/rerank", "/rerank"), RerankRequest, _rerank, models.reranker)


def _router(
    paths: tuple[str, ...],
    schema: type[Body],
    answer: Answer[Body],
    lease: Lease[EmbeddingService],
) -> APIRouter:
    """POST ``paths``: ``answer`` each parsed body with the model it names (``lease``)."""
    router = APIRouter()

    async def route(request: Request) -> Response:
        return await collect(request, schema, lease, answer)

    for path in paths:
        router.add_api_route(path, route, methods=["POST"])
    return router


async def _embed(body: EmbeddingRequest, service: EmbeddingService) -> dict[str, Any]:
    done = service.embed(
        _inputs(body.input),
        truncate=body.truncate,
        dimensions=body.dimensions,
        prompt_name=body.prompt_name,
        prompt=body.prompt,
    )
    return embeddings_json(await done, body.model or service.model_id, body.encoding_format)


async def _rerank(body: RerankRequest, service: EmbeddingService) -> dict[str, Any]:
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    done = service.rerank(
        body.query,
        texts,
        top_n=body.top_n,
        truncate=body.truncate,
        instruction=body.instruction,
    )
    model = body.model or service.model_id
    return rerank_json(await done, model, texts if body.return_documents else None)


def _inputs(value: Any) -> list[Any]:
    """Every shape of ``input`` as a list of strings or a list of token-id lists."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(v, int) for v in value):
        return [list(value)]
    return list(value)
