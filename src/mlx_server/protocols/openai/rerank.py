"""``POST /v1/rerank`` (and ``/rerank``): documents ranked against a query by a cross-encoder.

The shape llama-server, Jina and Cohere share: ``query``, ``documents`` (strings, or objects
with a ``text``), ``top_n``, ``return_documents``; the answer's ``results`` hold ``index``
and ``relevance_score``, best first (with ``document: {"text"}`` when asked for).
``instruction`` (an extension) states the task, as Qwen3-Reranker's ``<Instruct>`` line does
(its default: web search); a cross-encoder reads it as a prefix of the query.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, StrictStr

from mlx_server.embedding_service import EmbeddingService, Ranking
from mlx_server.protocols.openai.encoder_route import EncoderBody, encoder_router
from mlx_server.registry.lease import Models

PATHS = ("/v1/rerank", "/rerank")


class Document(BaseModel):
    model_config = ConfigDict(extra="ignore")
    text: StrictStr


class RerankRequest(EncoderBody):
    query: StrictStr
    documents: list[StrictStr | Document]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = False
    truncate: bool = False
    instruction: StrictStr | None = None


def make_router(models: Models) -> APIRouter:
    """The rerank routes (a chat model named, or the only one served: a 400 naming it)."""
    return encoder_router(PATHS, RerankRequest, _answer, models)


async def _answer(body: RerankRequest, service: EmbeddingService) -> dict[str, Any]:
    model = body.model or service.model_id
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    done = service.rerank(
        body.query,
        texts,
        top_n=body.top_n,
        truncate=body.truncate,
        instruction=body.instruction,
    )
    return rerank_json(await done, model, texts if body.return_documents else None)


def rerank_json(ranking: Ranking, model: str, documents: list[str] | None) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    for r in ranking.results:
        entry: dict[str, Any] = {"index": r.index, "relevance_score": r.score}
        if documents is not None:
            entry["document"] = {"text": documents[r.index]}
        results.append(entry)
    usage = {"prompt_tokens": ranking.prompt_tokens, "total_tokens": ranking.prompt_tokens}
    return {"object": "list", "model": model, "results": results, "usage": usage}
