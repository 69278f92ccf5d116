"""One step of the embedding engine: a padded batch through an encoder, pooled.

Inputs are right-padded to the longest in the batch; the attention mask keeps padding out
of every token's state and out of the pooling, so a vector does not depend on what it was
batched with (up to float rounding).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from mlx_server.models.embedding import EncoderSpec


class EncoderRunner:
    """Runs batches of token ids through an embedding model or a cross-encoder (MLX's
    thread only). ``run`` returns float32 vectors (embeddings) or scores (rerank)."""

    def __init__(self, model: Any, spec: EncoderSpec, pad_id: int = 0):
        self.model = model
        self.spec = spec
        self.pad_id = pad_id

    def run(self, seqs: list[list[int]], type_ids: list[list[int]] | None = None) -> np.ndarray:
        ids, mask, types = self._pad(seqs, type_ids)
        # The models take the mask as the tokenizer gives it (integers): some index with it.
        int_mask = mask.astype(mx.int32)
        if self.spec.kind == "rerank":
            logits = self.model(ids, attention_mask=int_mask, token_type_ids=types)
            scores = mx.sigmoid(logits) if self.spec.score_activation == "sigmoid" else logits
            return np.array(scores.astype(mx.float32))
        states = self.model(ids, attention_mask=int_mask).last_hidden_state
        pooled = pool(states.astype(mx.float32), mask, self.spec.pooling)
        if self.spec.normalize:
            pooled = l2_normalize(pooled)
        return np.array(pooled)

    def _pad(
        self, seqs: list[list[int]], type_ids: list[list[int]] | None
    ) -> tuple[mx.array, mx.array, mx.array | None]:
        width = max(len(s) for s in seqs)
        ids = np.full((len(seqs), width), self.pad_id, dtype=np.int32)
        mask = np.zeros((len(seqs), width), dtype=np.float32)
        types = np.zeros((len(seqs), width), dtype=np.int32)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = s
            mask[i, : len(s)] = 1.0
            if type_ids is not None:
                types[i, : len(s)] = type_ids[i]
        return mx.array(ids), mx.array(mask), mx.array(types) if type_ids is not None else None


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
