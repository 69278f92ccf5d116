"""What Ollama's model routes say about the models on offer: ``/api/tags`` (every offered
model), ``/api/ps`` (the loaded ones), ``/api/show`` (one model's template, parameters,
capabilities and context length). A server with several models answers from its registry;
a single ``--model`` is described from its chat service."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from mlx_server.embedding_service import EmbeddingService
from mlx_server.errors import NotFound
from mlx_server.registry.lease import Models, OneModel, RegistryModels
from mlx_server.service import ChatService

# ``expires_at`` of a model kept loaded for good (Ollama writes a far-future time too).
FOREVER = datetime(2318, 1, 1, tzinfo=timezone.utc)


@dataclass
class ModelView:
    """One model as the Ollama routes describe it."""

    id: str
    kind: str = "chat"  # "chat", "vision", "embedding"
    path: str | None = None
    disk_bytes: int = 0
    loaded: bool = True
    memory_bytes: int = 0
    expires_in: float = math.inf  # seconds until an idle unload
    service: ChatService | None = None  # a chat model's, while loaded
    config: dict[str, Any] = field(default_factory=dict)
    ctx_size: int = 0  # the context the server enforces for it

    @property
    def modified_at(self) -> str:
        stamp = Path(self.path).stat().st_mtime if self.path and Path(self.path).exists() else 0
        return _rfc3339(datetime.fromtimestamp(stamp, timezone.utc))

    @property
    def digest(self) -> str:
        """A stable id for the model (Ollama's is its manifest's sha256)."""
        return hashlib.sha256(f"{self.id}\0{self.path or ''}".encode()).hexdigest()

    def details(self) -> dict[str, Any]:
        quant = self.config.get("quantization") or self.config.get("quantization_config") or {}
        bits = quant.get("bits") if isinstance(quant, dict) else None
        family = str(self.config.get("model_type") or "")
        return {
            "parent_model": "",
            "format": "gguf" if (self.path or "").endswith(".gguf") else "mlx",
            "family": family,
            "families": [family] if family else None,
            "parameter_size": "",
            "quantization_level": f"Q{bits}" if bits else str(self.config.get("torch_dtype") or ""),
        }

    def capabilities(self) -> list[str]:
        if self.kind == "embedding":
            return ["embedding"]
        caps = ["completion"]
        service = self.service
        if service is not None and service.tool_format is not None:
            caps.append("tools")
        if self.kind == "vision" or (service is not None and service.vision is not None):
            caps.append("vision")
        if service is not None and "think" in (service.template or ""):
            caps.append("thinking")
        return caps


def views(models: Models) -> list[ModelView]:
    """Every offered model."""
    if isinstance(models, OneModel):
        return [_single(models.service)]
    assert isinstance(models, RegistryModels)
    registry = models.registry
    # Every chat model is served with the same --ctx-size, loaded or not.
    return [_from_slot(slot, registry, models.ctx_size) for slot in registry.slots.values()]


def find(models: Models, name: str) -> ModelView:
    """The model ``name`` names (a single model answers to any name, as on /v1); 404 if none."""
    every = views(models)
    if isinstance(models, OneModel):
        return every[0]
    for view in every:
        if name in (view.id, f"{view.id}:latest"):
            return view
    raise NotFound(f"model '{name}' not found")


def tag_entry(view: ModelView) -> dict[str, Any]:
    return {
        "name": view.id,
        "model": view.id,
        "modified_at": view.modified_at,
        "size": view.disk_bytes,
        "digest": view.digest,
        "details": view.details(),
    }


def ps_entry(view: ModelView) -> dict[str, Any]:
    if math.isinf(view.expires_in):
        expires = FOREVER
    else:
        expires = datetime.now(timezone.utc) + timedelta(seconds=view.expires_in)
    size = view.memory_bytes or view.disk_bytes
    return {
        "name": view.id,
        "model": view.id,
        "size": size,
        "digest": view.digest,
        "details": view.details(),
        "expires_at": _rfc3339(expires),
        "size_vram": size,
        "context_length": view.ctx_size,
    }


def show(view: ModelView) -> dict[str, Any]:
    service = view.service
    ctx_size = view.ctx_size
    template = (service.template or "") if service is not None else ""
    arch = view.details()["family"] or "mlx"
    info: dict[str, Any] = {"general.architecture": arch, f"{arch}.context_length": ctx_size}
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if isinstance(view.config.get(key), int):
            info[f"{arch}.{key}"] = view.config[key]
    return {
        "modelfile": f"# Served by mlx-server\nFROM {view.path or view.id}\n",
        "parameters": f"num_ctx {ctx_size}",
        "template": template,
        "details": view.details(),
        "model_info": info,
        "capabilities": view.capabilities(),
        "modified_at": view.modified_at,
    }


def _single(service: ChatService | EmbeddingService) -> ModelView:
    path = _model_dir(service.tokenizer)
    if isinstance(service, EmbeddingService):
        kind, chat = "embedding", None
    else:
        kind, chat = "chat" if service.vision is None else "vision", service
    return ModelView(
        service.model_id,
        kind=kind,
        path=str(path) if path else None,
        disk_bytes=_disk_bytes(path),
        service=chat,
        config=_read_config(path),
        ctx_size=chat.ctx_size if chat is not None else 0,
    )


def _from_slot(slot: Any, registry: Any, ctx_size: int) -> ModelView:
    parts = slot.parts if slot.state == "loaded" else None
    # The registry's own rule (registry.expired): the last keep_alive, else the idle limit.
    ttl = slot.keep_alive if slot.keep_alive is not None else registry.limits.idle_s or math.inf
    expires = math.inf if slot.pinned or math.isinf(ttl) else ttl
    if not math.isinf(expires):
        expires = max(0.0, slot.last_used + expires - registry.clock())
    config = _read_config(Path(slot.offer.path))
    return ModelView(
        slot.id,
        kind=slot.offer.kind,
        path=slot.offer.path,
        disk_bytes=slot.offer.disk_bytes,
        loaded=parts is not None,
        memory_bytes=slot.memory_bytes,
        expires_in=expires,
        service=parts.service if parts is not None and slot.offer.kind != "embedding" else None,
        config=config,
        ctx_size=_context(slot, parts, ctx_size, config),
    )


def _context(slot: Any, parts: Any, ctx_size: int, config: dict[str, Any]) -> int:
    """The context the server enforces: a chat model's ``--ctx-size``; an embedding model's
    longest input (its own maximum, while loaded; before, its config's, within the size)."""
    if slot.offer.kind != "embedding":
        return ctx_size
    if parts is not None:
        return int(parts.service.max_length)
    own = int(config.get("max_position_embeddings") or 0)
    return min(own, ctx_size) if own else ctx_size


def _model_dir(tokenizer: Any) -> Path | None:
    """A single model's folder: where its tokenizer was loaded from."""
    name = getattr(tokenizer, "name_or_path", None)
    path = Path(str(name)).expanduser() if name else None
    return path if path is not None and path.exists() else None


def _read_config(path: Path | None) -> dict[str, Any]:
    if path is None or not (path / "config.json").is_file():
        return {}
    try:
        value = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _disk_bytes(path: Path | None) -> int:
    if path is None:
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.glob("*") if p.is_file())


def _rfc3339(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")
