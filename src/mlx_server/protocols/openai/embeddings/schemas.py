"""The bodies of the endpoints an embedding or reranker model serves.

``POST /v1/embeddings`` (and ``/embeddings``), OpenAI's embeddings API: ``input`` is a
string, a list of strings, a list of token ids or a list of such lists; ``encoding_format``
is ``float`` or ``base64`` (little-endian float32, as OpenAI's SDKs decode it);
``dimensions`` cuts and re-normalises. ``truncate: true`` (llama.cpp's and TEI's extension)
cuts over-long inputs instead of refusing them. ``prompt_name`` (TEI's and
sentence-transformers' name) picks one of the model's named prompts, e.g. ``"query"`` for
Qwen3-Embedding's retrieval instruction; ``prompt`` gives the prefix itself.

``POST /v1/rerank`` (and ``/rerank``), documents ranked against a query by a cross-encoder,
in the shape llama-server, Jina and Cohere share: ``query``, ``documents`` (strings, or
objects with a ``text``), ``top_n``, ``return_documents``. ``instruction`` (an extension)
states the task, as Qwen3-Reranker's ``<Instruct>`` line does (its default: web search); a
cross-encoder reads it as a prefix of the query.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from mlx_server.registry.keep_alive import KeepAliveField


class EncoderBody(BaseModel):
    """What the embeddings and rerank bodies share: the model they name."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    # Several models: how long the named one stays loaded after this request (Ollama's
    # keep_alive, checked where models load).
    keep_alive: KeepAliveField = None


class EmbeddingRequest(EncoderBody):
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None
    truncate: bool = False
    prompt_name: StrictStr | None = None
    prompt: StrictStr | None = None


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
