"""An embedding or reranker model's results → OpenAI's embeddings list and the rerank
answer (``results`` of ``index`` and ``relevance_score``, best first, with
``document: {"text"}`` when asked for)."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from mlx_server.embedding_service import Embeddings, Ranking


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


def rerank_json(ranking: Ranking, model: str, documents: list[str] | None) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    for r in ranking.results:
        entry: dict[str, Any] = {"index": r.index, "relevance_score": r.score}
        if documents is not None:
            entry["document"] = {"text": documents[r.index]}
        results.append(entry)
    usage = {"prompt_tokens": ranking.prompt_tokens, "total_tokens": ranking.prompt_tokens}
    return {"object": "list", "model": model, "results": results, "usage": usage}
