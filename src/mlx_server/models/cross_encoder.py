"""Cross-encoder rerankers: ``BertForSequenceClassification`` and
``XLMRobertaForSequenceClassification`` (bge-reranker-base/large, bge-reranker-v2-m3) on
mlx-embeddings' encoders.

mlx-embeddings has the encoders but no classification heads. A BERT reranker is the encoder
under ``bert.`` plus ``classifier``, one linear layer on the pooled first token; an XLM-R
reranker is the encoder (without its pooler) under ``roberta.`` plus ``classifier.dense``,
a tanh and ``classifier.out_proj`` on the first token's state (transformers'
``RobertaClassificationHead``). So the heads are a few layers here and everything below
them is the library's model.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_server.models.base import ModelLoadError


class BertCrossEncoder(nn.Module):
    """Token ids of (query, document) pairs in, one relevance logit per pair out."""

    def __init__(self, encoder: nn.Module, hidden_size: int, num_labels: int = 1):
        super().__init__()
        self.bert = encoder
        self.classifier = nn.Linear(hidden_size, num_labels)

    def __call__(
        self, input_ids: mx.array, attention_mask: mx.array, token_type_ids: mx.array
    ) -> mx.array:
        out = self.bert(input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask)
        return self.classifier(out.pooler_output)[:, 0]


class RobertaClassificationHead(nn.Module):
    def __init__(self, hidden_size: int, num_labels: int = 1):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, num_labels)

    def __call__(self, first_token: mx.array) -> mx.array:
        return self.out_proj(mx.tanh(self.dense(first_token)))


class XLMRobertaCrossEncoder(nn.Module):
    """As BertCrossEncoder, for XLM-RoBERTa: no token types (one segment embedding), the
    head on the ``<s>`` token's state."""

    def __init__(self, encoder: nn.Module, hidden_size: int, num_labels: int = 1):
        super().__init__()
        self.roberta = encoder
        self.classifier = RobertaClassificationHead(hidden_size, num_labels)

    def __call__(
        self, input_ids: mx.array, attention_mask: mx.array, token_type_ids: mx.array | None
    ) -> mx.array:
        # One segment embedding: the pair's second-segment ids would index past it.
        out = self.roberta(input_ids, attention_mask=attention_mask)
        return self.classifier(out.last_hidden_state[:, 0])[:, 0]


# architecture -> (head class, config overrides for the encoder mlx-embeddings builds)
HEADS: dict[str, tuple[Any, dict[str, Any]]] = {
    "BertForSequenceClassification": (BertCrossEncoder, {}),
    "XLMRobertaForSequenceClassification": (XLMRobertaCrossEncoder, {"add_pooling_layer": False}),
}


def load_cross_encoder(model_dir: Path, config: dict[str, Any]) -> nn.Module:
    """The reranker in ``model_dir``, weights loaded and evaluated."""
    arch = (config.get("architectures") or [""])[0]
    if arch not in HEADS:
        raise ModelLoadError(
            f"reranker architecture {arch!r} is not supported (supported: {', '.join(HEADS)})"
        )
    from mlx_embeddings.utils import _get_classes

    head, overrides = HEADS[arch]
    config = {**config, **overrides}
    model_class, args_class, _, _ = _get_classes(config)
    model = head(model_class(args_class.from_dict(config)), int(config["hidden_size"]))
    weights: dict[str, mx.array] = {}
    for path in sorted(glob.glob(str(model_dir / "*.safetensors"))):
        weights.update(mx.load(path))  # type: ignore[arg-type]
    if not weights:
        raise ModelLoadError(f"no .safetensors weights in {model_dir}")
    weights = {k: v for k, v in weights.items() if not k.endswith("position_ids")}
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    model.eval()
    return model
