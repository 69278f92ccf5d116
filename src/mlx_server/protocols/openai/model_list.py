"""OpenAI's ``GET /v1/models``: the models served, and their entries as every app of this
server writes them."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter

from mlx_server.registry.lease import Models


def model_object(id: str, **fields: Any) -> dict[str, Any]:
    """One model's entry: OpenAI's fields, then this server's ``fields`` (capabilities,
    context size, a registry's load state ...)."""
    return {
        "id": id,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "mlx",
        **fields,
    }


def make_router(models: Models) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        data = [model_object(**entry) for entry in models.listing()]
        return {"object": "list", "data": data}

    return router
