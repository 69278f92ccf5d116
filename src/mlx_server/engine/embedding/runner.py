"""One step of the embedding engine: a padded batch through an encoder, pooled.

Inputs are right-padded to the longest in the batch; the attention mask keeps padding out
of every token's state and out of the pooling, so a vector does not depend on what it was
batched with (up to float rounding).

The step (encoder, pooling, normalisation or score activation) runs as one ``mx.compile``d
function: MLX fuses its elementwise work (GELU, the mask, softmax, layer norms), which the
encoder's matmuls otherwise wait on (32 passages of 256 tokens on the demo model: about a
quarter less time on a 2-core CPU). MLX traces it once per batch shape and keeps every
trace; the traces are dropped after ``MAX_TRACES`` shapes so that a long-running server's
memory stays bounded. A model whose code branches on array values cannot be traced; it runs
uncompiled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_server.logs import log
from mlx_server.models.embedding import EncoderSpec

Step = Callable[[mx.array, mx.array, mx.array], mx.array]
MAX_TRACES = 512  # batch shapes (inputs x tokens) traced before the traces are dropped


class EncoderRunner:
    """Runs batches of token ids through an embedding model or a cross-encoder (MLX's
    thread only). ``run`` returns float32 vectors (embeddings) or scores (rerank)."""

    def __init__(self, model: Any, spec: EncoderSpec, pad_id: int = 0, *, compile: bool = True):
        self.model = model
        self.spec = spec
        self.pad_id = pad_id
        self._eager: Step = self._score if spec.kind == "rerank" else self._embed
        self._compiled: Step | None = mx.compile(self._eager) if compile else None
        self._shapes: set[tuple[int, ...]] = set()

    def run(self, seqs: list[list[int]], type_ids: list[list[int]] | None = None) -> np.ndarray:
        ids, mask, types = self._pad(seqs, type_ids)
        if self._compiled is not None:
            self._shapes.add(tuple(ids.shape))
            if len(self._shapes) > MAX_TRACES:  # a new function: the old one's traces go
                self._compiled, self._shapes = mx.compile(self._eager), {tuple(ids.shape)}
            try:
                return np.array(self._compiled(ids, mask, types))
            except ValueError as e:  # the model evaluates an array while it is traced
                log(f"Encoder runs uncompiled: {e}")
                self._compiled = None
        return np.array(self._eager(ids, mask, types))

    def _embed(self, ids: mx.array, mask: mx.array, types: mx.array) -> mx.array:
        # The models take the mask as the tokenizer gives it (integers): some index with it.
        states = self.model(ids, attention_mask=mask.astype(mx.int32)).last_hidden_state
        pooled = pool(states.astype(mx.float32), mask, self.spec.pooling)
        return l2_normalize(pooled) if self.spec.normalize else pooled

    def _score(self, ids: mx.array, mask: mx.array, types: mx.array) -> mx.array:
        logits = self.model(ids, attention_mask=mask.astype(mx.int32), token_type_ids=types)
        scores = mx.sigmoid(logits) if self.spec.score_activation == "sigmoid" else logits
        return scores.astype(mx.float32)

    def _pad(
        self, seqs: list[list[int]], type_ids: list[list[int]] | None
    ) -> tuple[mx.array, mx.array, mx.array]:
        width = max(len(s) for s in seqs)
        ids = np.full((len(seqs), width), self.pad_id, dtype=np.int32)
        mask = np.zeros((len(seqs), width), dtype=np.float32)
        types = np.zeros((len(seqs), width), dtype=np.int32)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = s
            mask[i, : len(s)] = 1.0
            if type_ids is not None:
                types[i, : len(s)] = type_ids[i]
        return mx.array(ids), mx.array(mask), mx.array(types)


def pool(states: mx.array, mask: mx.array, mode: str) -> mx.array:
    """sentence-transformers' pooling modes over ``states`` (batch, tokens, width)."""
    weights = mask[:, :, None]
    lengths = mx.maximum(mask.sum(axis=1, keepdims=True), 1.0)
    if mode == "cls":
        return states[:, 0]
    if mode == "lasttoken":
        last = (mask.sum(axis=1) - 1).astype(mx.int32)
        return mx.take_along_axis(states, last[:, None, None], axis=1)[:, 0]
    if mode == "max":
        return mx.where(weights > 0, states, mx.array(-1e9, states.dtype)).max(axis=1)
    total = (states * weights).sum(axis=1)
    if mode == "mean_sqrt_len_tokens":
        return total / mx.sqrt(lengths)
    return total / lengths


def l2_normalize(x: mx.array) -> mx.array:
    return x / mx.maximum(mx.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
