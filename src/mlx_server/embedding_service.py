"""The embedding service: texts or token ids in, vectors or relevance scores out.

Both the embeddings and the rerank routes call this. It tokenizes (off the event loop),
checks every input against the model's maximum length (a 400 naming the input, unless the
request asks to truncate), queues the token ids on the embedding engine and shapes what
comes back (``dimensions``: cut and re-normalised).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlx_server.errors import InvalidRequest, article
from mlx_server.models.embedding import EncoderSpec

MAX_INPUTS = 2048  # OpenAI's limit on inputs per embeddings request


@dataclass(frozen=True)
class Embeddings:
    vectors: list[np.ndarray]  # float32, one per input, in order
    prompt_tokens: int


@dataclass(frozen=True)
class Ranked:
    index: int
    score: float


@dataclass(frozen=True)
class Ranking:
    results: list[Ranked]  # best first
    prompt_tokens: int


class EmbeddingService:
    """Embeddings or reranking on one encoder model and its engine."""

    def __init__(
        self,
        model_id: str,
        tokenizer: Any,
        engine: Any,
        spec: EncoderSpec,
        *,
        ctx_size: int,
        pair_prompt: Any = None,
    ):
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.engine = engine
        self.spec = spec
        self.pair_prompt = pair_prompt  # a causal reranker's ChatPairPrompt, else None
        self.max_length = min(spec.max_length, ctx_size)
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        # A second tokenizer that truncates, so neither is ever reconfigured while in use.
        self._truncating = type(tokenizer).from_str(tokenizer.to_str())
        self._truncating.enable_truncation(self.max_length, strategy="longest_first")
        self.capabilities = ["rerank"] if spec.kind == "rerank" else ["embeddings"]

    @property
    def kind(self) -> str:
        return self.spec.kind

    # ---- embeddings --------------------------------------------------------------------

    async def embed(
        self,
        inputs: list[str] | list[list[int]],
        *,
        truncate: bool,
        dimensions: int | None,
        prompt_name: str | None = None,
        prompt: str | None = None,
    ) -> Embeddings:
        """Vectors of ``inputs``. Text inputs get a prefix as sentence-transformers'
        ``encode`` gives one: ``prompt``, else the model's prompt named ``prompt_name`` (e.g.
        Qwen3-Embedding's ``query`` instruction), else the model's default prompt."""
        self._check_kind("embedding", "/v1/embeddings")
        _check_count(inputs, "input")
        if dimensions is not None and not 1 <= dimensions <= self.spec.dimensions:
            raise InvalidRequest(
                f"dimensions must be between 1 and the model's {self.spec.dimensions} "
                f"(got {dimensions})",
                param="dimensions",
            )
        if all(isinstance(x, str) for x in inputs):
            prefix = self._prefix(prompt_name, prompt)
            seqs = await self._tokenize([prefix + str(x) for x in inputs], truncate)
        else:
            if prompt_name is not None or prompt is not None:
                param = "prompt" if prompt is not None else "prompt_name"
                raise InvalidRequest(f"{param} applies to text inputs, not token ids", param=param)
            seqs = [self._check_ids(_ids(x), i, truncate) for i, x in enumerate(inputs)]
        rows = await self._run(seqs, None)
        vectors = [_shape(np.asarray(r, dtype=np.float32), dimensions) for r in rows]
        return Embeddings(vectors, sum(len(s) for s in seqs))

    def _prefix(self, prompt_name: str | None, prompt: str | None) -> str:
        if prompt is not None:
            return prompt
        name = prompt_name if prompt_name is not None else self.spec.default_prompt
        if name is None:
            return ""
        if name not in self.spec.prompts:
            known = ", ".join(repr(k) for k in self.spec.prompts) or "none"
            raise InvalidRequest(
                f"prompt_name {name!r} is not one of the model's prompts ({known})",
                param="prompt_name",
            )
        return self.spec.prompts[name]

    async def _tokenize(self, texts: list[str], truncate: bool) -> list[list[int]]:
        for i, text in enumerate(texts):
            if not text:
                raise InvalidRequest(f"input[{i}] is an empty string", param="input")
        tokenizer = self._truncating if truncate else self.tokenizer
        encodings = await asyncio.to_thread(tokenizer.encode_batch, texts)
        seqs = [list(e.ids) for e in encodings]
        for i, s in enumerate(seqs):
            self._check_length(len(s), f"input[{i}]", "input")
        return seqs

    def _check_ids(self, ids: list[int], i: int, truncate: bool) -> list[int]:
        if not ids:
            raise InvalidRequest(f"input[{i}] is an empty list of tokens", param="input")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                f"input[{i}] holds token id {bad}, outside the vocabulary (0 to "
                f"{self.vocab_size - 1})",
                param="input",
            )
        if truncate:
            return ids[: self.max_length]
        self._check_length(len(ids), f"input[{i}]", "input")
        return ids

    def _check_length(self, n: int, what: str, param: str) -> None:
        if n > self.max_length:
            raise InvalidRequest(
                f"{what} has {n} tokens, more than the model's maximum of {self.max_length}; "
                "shorten it, or set truncate: true",
                param=param,
                code="context_length_exceeded",
            )

    # ---- rerank ------------------------------------------------------------------------

    async def rerank(
        self,
        query: str,
        documents: list[str],
        *,
        top_n: int | None,
        truncate: bool,
        instruction: str | None = None,
    ) -> Ranking:
        """Documents ranked by relevance to ``query``. An ``instruction`` (the task, as
        Qwen3-Reranker's ``<Instruct>``) is given as sentence-transformers' ``prompt``: the
        system message of a causal reranker's template, a prefix of a cross-encoder's query."""
        self._check_kind("rerank", "/v1/rerank")
        if not query:
            raise InvalidRequest("query is an empty string", param="query")
        _check_count(documents, "documents")
        for i, doc in enumerate(documents):
            if not doc:
                raise InvalidRequest(f"documents[{i}] is an empty string", param="documents")
        seqs, types = await asyncio.to_thread(self._pairs, query, documents, instruction, truncate)
        for i, s in enumerate(seqs):
            self._check_length(len(s), f"query with documents[{i}]", "documents")
        scores = await self._run(seqs, types)
        ranked = sorted((Ranked(i, float(s)) for i, s in enumerate(scores)), key=lambda r: -r.score)
        return Ranking(ranked[:top_n] if top_n else ranked, sum(len(s) for s in seqs))

    def _pairs(
        self, query: str, documents: list[str], instruction: str | None, truncate: bool
    ) -> tuple[list[list[int]], list[list[int]] | None]:
        """Token ids (and token types) of each (query, document) pair."""
        if self.pair_prompt is not None:
            limit = self.max_length if truncate else None
            return self.pair_prompt.encode(query, documents, instruction, limit), None
        tokenizer = self._truncating if truncate else self.tokenizer
        first = query if instruction is None else instruction + query
        encodings = tokenizer.encode_batch([(first, d) for d in documents])
        return [list(e.ids) for e in encodings], [list(e.type_ids) for e in encodings]

    # ---- shared ------------------------------------------------------------------------

    async def _run(self, seqs: list[list[int]], type_ids: list[list[int]] | None) -> list[Any]:
        future = self.engine.encode(seqs, type_ids)
        try:
            return list(await future)
        finally:
            future.cancel()  # a client gone mid-request: its waiting inputs are dropped

    def _check_kind(self, kind: str, route: str) -> None:
        if self.spec.kind != kind:
            other = "/v1/rerank" if self.spec.kind == "rerank" else "/v1/embeddings"
            raise InvalidRequest(
                f"the model '{self.model_id}' is {article(self.spec.kind)} {self.spec.kind} "
                f"model; it serves {other}, "
                f"not {route}",
                param="model",
                code="model_not_supported",
            )


def _ids(value: Any) -> list[int]:
    if isinstance(value, str):  # a list mixing strings and token lists
        raise InvalidRequest("input mixes strings and token lists", param="input")
    return [int(t) for t in value]


def _check_count(items: list[Any], param: str) -> None:
    if not items:
        raise InvalidRequest(f"{param} is an empty list", param=param)
    if len(items) > MAX_INPUTS:
        raise InvalidRequest(
            f"{param} holds {len(items)} items, more than the {MAX_INPUTS} allowed", param=param
        )


def _shape(vector: np.ndarray, dimensions: int | None) -> np.ndarray:
    """The first ``dimensions`` values, re-normalised (Matryoshka truncation)."""
    if dimensions is None or dimensions >= vector.shape[0]:
        return vector
    cut = vector[:dimensions]
    norm = float(np.linalg.norm(cut))
    return cut / norm if norm > 0 else cut
