"""A route whose answer is collected, not streamed (embeddings, rerank): parse the body,
lease the model it names, answer it as JSON unless the client leaves first."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from mlx_server.server.http import Lease, parse_and_lease
from mlx_server.server.streaming import until_disconnect

B = TypeVar("B", bound=BaseModel)
S = TypeVar("S")


async def collect(
    request: Request,
    schema: type[B],
    lease: Lease[S],
    answer: Callable[[B, S], Awaitable[dict[str, Any]]],
) -> Response:
    """``answer(body, model)`` as JSON, ``body`` parsed as ``schema`` (it has ``model`` and
    ``keep_alive``) and ``model`` leased by ``lease(request, body.model, body.keep_alive)``
    (e.g. ``Models.encoder``). A client gone first: the work is cancelled, and with it the
    inputs still waiting (499)."""
    body, model = await parse_and_lease(request, schema, lease)
    work = asyncio.ensure_future(answer(body, model))
    result = await until_disconnect(request, work, work.cancel)
    return Response(status_code=499) if result is None else JSONResponse(result)
