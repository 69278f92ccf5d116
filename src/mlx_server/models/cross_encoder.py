"""Cross-encoder rerankers: ``BertForSequenceClassification`` on mlx-embeddings' BERT.

mlx-embeddings has the BERT encoder and its pooler but no classification head; a reranker
checkpoint is that encoder under ``bert.`` plus ``classifier`` (one linear layer on the
pooled first token), so the head is one ``nn.Linear`` here and everything below it is the
library's model.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_server.models.base import ModelLoadError

SUPPORTED = ("BertForSequenceClassification",)


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


def load_cross_encoder(model_dir: Path, config: dict[str, Any]) -> BertCrossEncoder:
    """The reranker in ``model_dir``, weights loaded and evaluated."""
    arch = (config.get("architectures") or [""])[0]
    if arch not in SUPPORTED:
        raise ModelLoadError(
            f"reranker architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED)})"
        )
    from mlx_embeddings.utils import _get_classes

    model_class, args_class, _, _ = _get_classes(config)
    model = BertCrossEncoder(model_class(args_class.from_dict(config)), int(config["hidden_size"]))
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
