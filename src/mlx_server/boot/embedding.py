"""Embedding start-up: Settings into a loaded embedding or reranker model, its started engine
and its service."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_server.config import Settings
from mlx_server.embedding_service import EmbeddingService
from mlx_server.engine.embedding.engine import EmbeddingEngine, EmbeddingEngineConfig
from mlx_server.engine.embedding.runner import EncoderRunner
from mlx_server.logs import log
from mlx_server.models.embedding import is_encoder_model, load_encoder
from mlx_server.models.loader import default_model_id, resolve_model_dir
from mlx_server.startup_report import weights_line


def serves_embeddings(settings: Settings) -> Path | None:
    """The model directory when the model is to be served as an embedding/reranker model
    (its files say so); None for a chat model, which ``--embedding`` leaves a chat model."""
    model_dir = resolve_model_dir(settings.model)
    return model_dir if is_encoder_model(model_dir) else None


@dataclass
class EncoderParts:
    """One loaded encoder as served: its embedding service and its started engine."""

    service: Any
    engine: Any
    loaded: Any  # the LoadedEncoder


def load_embedding_model(settings: Settings, model_dir: Path) -> EncoderParts:
    """Load the encoder and start its engine (as ModelParts are, for the registry too)."""
    model_id = settings.model_id or default_model_id(settings.model)
    loaded = load_encoder(model_dir, model_id=model_id, dtype=settings.dtype)
    spec = loaded.spec
    log(
        f"Model id: {loaded.model_id} ({loaded.path}): {spec.kind} model, "
        f"{_network(spec)}, "
        f"{spec.dimensions} dimensions, up to {spec.max_length} tokens"
    )
    log(weights_line(loaded.model, loaded.config, settings.dtype))
    config = EmbeddingEngineConfig(max_queue=settings.max_queue)
    if settings.max_batch_size:
        config.max_batch_size = settings.max_batch_size
    engine = EmbeddingEngine(EncoderRunner(loaded.model, spec, loaded.pad_id), config)
    service = EmbeddingService(
        loaded.model_id,
        loaded.tokenizer,
        engine,
        spec,
        ctx_size=settings.ctx_size,
        pair_prompt=loaded.pair_prompt,
    )
    engine.start()
    engine.wait_ready()
    return EncoderParts(service, engine, loaded)


def _network(spec: Any) -> str:
    if spec.kind == "embedding":
        return f"{spec.pooling} pooling"
    return "causal LM scoring yes/no" if spec.head == "logit_score" else "cross-encoder"
