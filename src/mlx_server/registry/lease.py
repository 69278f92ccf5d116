"""The models a server serves, as its routes get them: every router is built with one
``Models``. A request names its model in its body, leases it for as long as its response
lasts (a stream's included) and uses that model's own service directly.

A single ``--model`` is ``OneModel``: every name is that model, nothing loads or unloads.
Several models are ``RegistryModels``: the registry loads the named one if need be, and the
lease keeps it loaded until the response has ended (``after_response``)."""

from __future__ import annotations

from typing import Any, Protocol

from fastapi import Request

from mlx_server.embedding_service import EmbeddingService
from mlx_server.engine.core.protocol import EngineCounters, OwnedEngine
from mlx_server.registry.keep_alive import parse_keep_alive
from mlx_server.registry.registry import LOADED, ModelRegistry, Slot, wrong_kind
from mlx_server.server.after_response import after_response
from mlx_server.service import ChatService

# /health's share of a chat engine's counters: prefix-cache counters (RAM and disk tiers),
# memory in use; a model of several reports whether its cache has a disk tier, and why not.
_HEALTH_STATS = ("prompt_cache_", "kv_in_use_bytes", "memory_")
_DISK_STATE = ("prompt_cache_disk", "prompt_cache_disk_dir", "prompt_cache_disk_off_reason")


class Models(Protocol):
    """What the routes serve. ``keep_alive``: the body's own (Ollama's meaning: how long
    the model stays loaded after this request); it is checked where models load."""

    async def chat(self, request: Request, name: str | None, keep_alive: Any = None) -> ChatService:
        """The chat model ``name`` (empty: the default), leased for ``request``."""
        ...

    async def encoder(
        self, request: Request, name: str | None, keep_alive: Any = None
    ) -> EmbeddingService:
        """The embedding or reranker model ``name``, leased for ``request`` (empty: the
        default, or the first embedder)."""
        ...

    async def reranker(
        self, request: Request, name: str | None, keep_alive: Any = None
    ) -> EmbeddingService:
        """As ``encoder``, for a rerank request: no name, the first reranker."""
        ...

    def engines(self) -> list[OwnedEngine]:
        """The loaded models' engines (``/v1/cancel`` reaches every one)."""
        ...

    def counters(self) -> EngineCounters:
        """Every loaded engine's counters as one (``/metrics``)."""
        ...

    def listing(self) -> list[dict[str, Any]]:
        """Each model's ``id`` and what ``/v1/models`` says of it (capabilities, context
        size, a registry's load state ...)."""
        ...

    def health(self) -> dict[str, Any]:
        """``/health``'s answer."""
        ...


class OneModel:
    """The one model a server was started with: a chat model, or an embedding or reranker
    model, whatever name a request gives."""

    def __init__(self, service: ChatService | EmbeddingService):
        self.service = service
        self.model_id = service.model_id

    async def chat(self, request: Request, name: str | None, keep_alive: Any = None) -> ChatService:
        if not isinstance(self.service, ChatService):  # its app refuses the chat routes first
            raise wrong_kind(self.model_id, "embedding")
        return self.service

    async def encoder(
        self, request: Request, name: str | None, keep_alive: Any = None
    ) -> EmbeddingService:
        if not isinstance(self.service, EmbeddingService):
            instead = "start the server with an embedding or reranker model (or --embedding)"
            raise wrong_kind(self.model_id, "chat", instead)
        return self.service

    async def reranker(
        self, request: Request, name: str | None, keep_alive: Any = None
    ) -> EmbeddingService:
        return await self.encoder(request, name, keep_alive)

    def engines(self) -> list[OwnedEngine]:
        return [self.service.engine]

    def counters(self) -> EngineCounters:
        engine: EngineCounters = self.service.engine
        return engine

    def listing(self) -> list[dict[str, Any]]:
        service = self.service
        if isinstance(service, EmbeddingService):
            return [{"id": service.model_id, "capabilities": service.capabilities}]
        entry = {"id": service.model_id, **service.context_info()}
        if service.capabilities:
            entry["capabilities"] = service.capabilities
        return [entry]

    def health(self) -> dict[str, Any]:
        service = self.service
        engine = service.engine
        counts = {"active": engine.active_count, "queued": engine.queue_depth}
        if isinstance(service, EmbeddingService):
            # inputs waiting, and inputs, tokens and batches done
            stats = {k: v for k, v in engine.stats().items() if isinstance(v, int)}
            return {"status": "ok", **stats, **counts}
        body: dict[str, Any] = {"status": "ok", **counts, **service.context_info()}
        # work left for idle time (warm-up pieces, structured output's tokenizer): a request
        # arriving while a piece runs waits for it (benchmarks wait for false)
        body["warming_up"] = bool(getattr(engine, "warming_up", False))
        if error := getattr(engine, "start_error", ""):  # failed after the readiness line
            body.update(status="error", error=f"the model cannot serve: {error}")
        body.update({k: v for k, v in engine.stats().items() if k.startswith(_HEALTH_STATS)})
        return body


class RegistryModels:
    """The registry's models; ``ctx_size``: the context every chat model is served with."""

    def __init__(self, registry: ModelRegistry, ctx_size: int):
        self.registry = registry
        self.ctx_size = ctx_size

    async def _lease(self, request: Request, name: str | None, keep_alive: Any, serves: str) -> Any:
        """The model's service; a model of the other kind is a 400, an unknown one a 404
        (each in the envelope of the route's protocol)."""
        seconds = parse_keep_alive(keep_alive)
        slot = await self.registry.acquire(name or "", seconds, serves)
        after_response(request, lambda: self.registry.release(slot))
        return slot.parts.service

    async def chat(self, request: Request, name: str | None, keep_alive: Any = None) -> ChatService:
        service: ChatService = await self._lease(request, name, keep_alive, "chat")
        return service

    async def encoder(
        self, request: Request, name: str | None, keep_alive: Any = None
    ) -> EmbeddingService:
        service: EmbeddingService = await self._lease(request, name, keep_alive, "embedding")
        return service

    async def reranker(
        self, request: Request, name: str | None, keep_alive: Any = None
    ) -> EmbeddingService:
        service: EmbeddingService = await self._lease(request, name, keep_alive, "rerank")
        return service

    def engines(self) -> list[OwnedEngine]:
        return [s.parts.engine for s in self.registry.loaded() if s.parts is not None]

    def counters(self) -> EngineCounters:
        return LoadedEngines(self)

    def listing(self) -> list[dict[str, Any]]:
        return [self._entry(s) for s in self.registry.slots.values()]

    def _entry(self, slot: Slot) -> dict[str, Any]:
        """One model's entry: its state, and while loaded its capabilities."""
        entry: dict[str, Any] = {
            "id": slot.id,
            "status": slot.state,
            "kind": slot.offer.kind,
            "context_length": self.ctx_size,
            "pinned": slot.pinned,
        }
        if slot.state == LOADED and slot.parts is not None:
            entry["memory_bytes"] = slot.memory_bytes
            service = slot.parts.service
            if isinstance(service, EmbeddingService):  # its longest input, not --ctx-size
                entry["context_length"] = service.max_length
            if service.capabilities:
                entry["capabilities"] = list(service.capabilities)
            if isinstance(service, ChatService):  # the trained context and the like
                entry.update(service.context_info())
        return entry

    def health(self) -> dict[str, Any]:
        per_model = {s.id: _slot_health(s) for s in self.registry.slots.values()}
        return {
            "status": "ok",
            "active": sum(m.get("active", 0) for m in per_model.values()),
            "queued": sum(m.get("queued", 0) for m in per_model.values()),
            "models": per_model,
        }


def _slot_health(slot: Slot) -> dict[str, Any]:
    out: dict[str, Any] = {"status": slot.state}
    if slot.state == LOADED and slot.parts is not None:
        engine: EngineCounters = slot.parts.engine
        out.update(
            active=engine.active_count, queued=engine.queue_depth, memory_bytes=slot.memory_bytes
        )
        if hasattr(engine, "warming_up"):  # a chat model's engine (``OneModel.health``)
            out["warming_up"] = bool(engine.warming_up)
        out.update({k: v for k, v in engine.stats().items() if k in _DISK_STATE})
    return out


class LoadedEngines:
    """The counters of every loaded model's engine, summed (``EngineCounters``)."""

    def __init__(self, models: RegistryModels):
        self.models = models

    @property
    def active_count(self) -> int:
        return sum(e.active_count for e in self.models.engines())

    @property
    def queue_depth(self) -> int:
        return sum(e.queue_depth for e in self.models.engines())

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for e in self.models.engines():
            for k, v in e.stats().items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    out[k] = out.get(k, 0) + v
        return out
