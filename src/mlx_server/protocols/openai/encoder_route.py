"""What the embeddings and rerank routes share: the body parsed, its model leased (a chat
model is a 400 that says so), the encoder's answer collected unless the client leaves first."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from mlx_server.embedding_service import EmbeddingService
from mlx_server.registry.lease import Models
from mlx_server.server.http import parse_body
from mlx_server.server.streaming import until_disconnect


class EncoderBody(BaseModel):
    """What the embeddings and rerank bodies share: the model they name."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    # Several models: how long the named one stays loaded after this request (Ollama's
    # keep_alive, checked where models load).
    keep_alive: Any = None


Body = TypeVar("Body", bound=EncoderBody)
# The body's JSON answer from the service (raising what refuses the body).
Answer = Callable[[Body, EmbeddingService], Awaitable[dict[str, Any]]]


def encoder_router(
    paths: tuple[str, ...], schema: type[Body], answer: Answer[Body], models: Models
) -> APIRouter:
    """POST ``paths``: ``answer`` each parsed body with the embedding model it names."""
    router = APIRouter()

    async def route(request: Request) -> Response:
        body = await parse_body(request, schema)
        service = await models.encoder(request, body.model, body.keep_alive)
        # A client gone: the work is cancelled, and with it the inputs still waiting.
        work = asyncio.ensure_future(answer(body, service))
        result = await until_disconnect(request, work, work.cancel)
        return Response(status_code=499) if result is None else JSONResponse(result)

    for path in paths:
        router.add_api_route(path, route, methods=["POST"])
    return router
