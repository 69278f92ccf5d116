"""``POST /v1/embeddings`` (and ``/embeddings``): OpenAI's embeddings API.

``input`` is a string, a list of strings, a list of token ids or a list of such lists;
``encoding_format`` is ``float`` or ``base64`` (little-endian float32, as OpenAI's SDKs
decode it); ``dimensions`` cuts and re-normalises. ``truncate: true`` (llama.cpp's and
TEI's extension) cuts over-long inputs instead of refusing them. ``prompt_name`` (TEI's and
sentence-transformers' name) picks one of the model's named prompts, e.g. ``"query"`` for
Qwen3-Embedding's retrieval instruction; ``prompt`` gives the prefix itself.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter
from pydantic import StrictInt, StrictStr

from mlx_server.embedding_service import Embeddings, EmbeddingService
from mlx_server.protocols.openai.encoder_route import EncoderBody, encoder_router
from mlx_server.registry.lease import Models

PATHS = ("/v1/embeddings", "/embeddings")


class EmbeddingRequest(EncoderBody):
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None
    truncate: bool = False
    prompt_name: StrictStr | None = None
    prompt: StrictStr | None = None


def make_router(models: Models) -> APIRouter:
    """The embeddings routes (a chat model named, or the only one served: a 400 naming it)."""
    return encoder_router(PATHS, EmbeddingRequest, _answer, models)


async def _answer(body: EmbeddingRequest, service: EmbeddingService) -> dict[str, Any]:
    model = body.model or service.model_id
    done = service.embed(
        _inputs(body.input),
        truncate=body.truncate,
        dimensions=body.dimensions,
        prompt_name=body.prompt_name,
        prompt=body.prompt,
    )
    return embeddings_json(await done, model, body.encoding_format)


def _inputs(value: Any) -> list[Any]:
    """Every shape of ``input`` as a list of strings or a list of token-id lists."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(v, int) for v in value):
        return [list(value)]
    return list(value)


def embeddings_json(result: Embeddings, model: str, encoding: str) -> dict[str, Any]:
    data = [
        {"object": "embedding", "index": i, "embedding": _encode(v, encoding)}
        for i, v in enumerate(result.vectors)
    ]
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def _encode(vector: np.ndarray, encoding: str) -> Any:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]
