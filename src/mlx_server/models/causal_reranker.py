"""Causal-LM rerankers (Qwen3-Reranker): the relevance of a document is how much more the
model would answer "yes" than "no" after a prompt that asks it (models/rerank_prompt.py).

The score is ``logit(yes) - logit(no)`` at the last token, the log-odds the model card's
``log_softmax`` over the two logits turns into ``p(yes)`` (a sigmoid of the difference) and
what sentence-transformers' ``LogitScore`` module returns. The network is mlx-lm's model of
the architecture (quantized or not, tied embeddings or a separate head); only the last
token's hidden state is projected onto the vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_server.models.base import ModelLoadError


class CausalReranker(nn.Module):
    """Right-padded token ids of prompts in, one log-odds score per prompt out. Causal
    attention keeps the padding after a prompt out of its tokens' states, so the batch needs
    no padding mask; the mask only says where each prompt ends."""

    def __init__(self, lm: nn.Module, true_id: int, false_id: int | None):
        super().__init__()
        self.lm = lm
        self.true_id = true_id
        self.false_id = false_id

    def __call__(
        self, input_ids: mx.array, attention_mask: mx.array, token_type_ids: Any = None
    ) -> mx.array:
        hidden = self.lm.model(input_ids)
        last = (attention_mask.sum(axis=1) - 1).astype(mx.int32)
        final = mx.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
        logits = self._head(final).astype(mx.float32)
        score = logits[:, self.true_id]
        return score if self.false_id is None else score - logits[:, self.false_id]

    def _head(self, hidden: mx.array) -> mx.array:
        head = getattr(self.lm, "lm_head", None)
        if head is not None:
            return head(hidden)
        return self.lm.model.embed_tokens.as_linear(hidden)


def load_causal_reranker(model_dir: Path, tokens: tuple[int, int | None]) -> CausalReranker:
    """The causal reranker in ``model_dir`` (mlx-lm's loader), scoring with ``tokens``."""
    from mlx_lm.utils import load_model

    lm, config = load_model(model_dir)
    inner = getattr(lm, "model", None)
    if inner is None or not hasattr(inner, "embed_tokens"):
        raise ModelLoadError(
            f"{config.get('model_type')!r} models are not supported as rerankers (mlx-lm's "
            "model has no .model.embed_tokens to read hidden states from)"
        )
    vocab = int(config.get("vocab_size") or inner.embed_tokens.weight.shape[0])
    for t in tokens:
        if t is not None and not 0 <= t < vocab:
            raise ModelLoadError(f"score token id {t} is outside the vocabulary of {vocab}")
    lm.eval()
    return CausalReranker(lm, *tokens)
