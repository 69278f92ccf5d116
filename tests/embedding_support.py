"""Embedding test helpers: the embedding demo model's location, a tiny random-weight BERT
cross-encoder, and sentence-transformers references (CPU torch)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from support import REPO

EMBEDDING_DEMO_DIR = REPO / "models" / "all-minilm-l6-v2"
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)


def embedding_demo_dir() -> Path:
    """The embedding demo model (``mlx-server-demo --embedding`` puts it in models/); tests
    that need it fail loudly when it is missing."""
    d = EMBEDDING_DEMO_DIR
    assert (d / "model.safetensors").is_file(), (
        "embedding demo model missing: run `mlx-server-demo --embedding`"
    )
    return d


def build_tiny_cross_encoder(dest: Path, seed: int = 0) -> Path:
    """A ``BertForSequenceClassification`` reranker with random weights and one label, of
    real shape but tiny (2 layers, width 64), on the demo model's WordPiece tokenizer."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        num_labels=1,
        architectures=["BertForSequenceClassification"],
    )
    model = BertForSequenceClassification(config).eval()
    with torch.no_grad():  # spread the scores: random init gives nearly equal logits
        model.classifier.weight.mul_(100.0)
    model.save_pretrained(dest, safe_serialization=True)
    for name in _TOKENIZER_FILES:
        shutil.copy(embedding_demo_dir() / name, dest / name)
    config_path = dest / "config.json"
    cfg = json.loads(config_path.read_text())
    cfg["architectures"] = ["BertForSequenceClassification"]
    config_path.write_text(json.dumps(cfg, indent=2))
    return dest
