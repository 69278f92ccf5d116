"""What the embeddings and rerank routes share: a 400 naming the model when a chat model is
served, the body parsed, the encoder's answer collected unless the client leaves first."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from mlx_server.embedding_service import EmbeddingService
from mlx_server.errors import InvalidRequest
from mlx_server.server.http import parse_body
from mlx_server.server.streaming import until_disconnect

Body = TypeVar("Body", bound=BaseModel)
# The body's JSON answer from the service (raising what refuses the body).
Answer = Callable[[Body, EmbeddingService], Awaitable[dict[str, Any]]]


def encoder_router(
    paths: tuple[str, ...],
    schema: type[Body],
    answer: Answer[Body],
    service: EmbeddingService | None,
    model_id: str,
    refusal: str,
) -> APIRouter:
    """POST ``paths``: ``answer`` each parsed body; with no service (``model_id`` is a chat
    model), a 400 that says it, then ``refusal``."""
    router = APIRouter()
    message = f"the model '{model_id}' is a chat model and {refusal}"

    async def route(request: Request) -> Response:
        if service is None:
            raise InvalidRequest(message, param="model", code="model_not_supported")
        body = await parse_body(request, schema)
        # A client gone: the work is cancelled, and with it the inputs still waiting.
        work = asyncio.ensure_future(answer(body, service))
        result = await until_disconnect(request, work, work.cancel)
        return Response(status_code=499) if result is None else JSONResponse(result)

    for path in paths:
        router.add_api_route(path, route, methods=["POST"])
    return router
