"""Routes of a server with several models: the listing with each model's status, loading
and unloading on demand, health per model, and per-model gauges on ``/metrics``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

from fastapi import APIRouter, Request
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict

from mlx_server.engine.core.protocol import EngineLike
from mlx_server.protocols.openai.model_list import model_object
from mlx_server.registry.keep_alive import parse_keep_alive
from mlx_server.registry.registry import LOADED, ModelRegistry, Slot
from mlx_server.server.http import parse_body

_DISK_STATE = ("prompt_cache_disk", "prompt_cache_disk_dir", "prompt_cache_disk_off_reason")


class ModelAction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    binds_model: ClassVar[bool] = False  # these routes manage models; no request lease

    model: str
    keep_alive: float | str | None = None


def model_entry(slot: Slot, ctx_size: int) -> dict[str, Any]:
    """One ``/v1/models`` entry: OpenAI's fields, then the model's state."""
    entry = model_object(
        slot.id,
        status=slot.state,
        kind=slot.offer.kind,
        context_length=ctx_size,
        pinned=slot.pinned,
    )
    if slot.state == LOADED and slot.parts is not None:
        entry["memory_bytes"] = slot.memory_bytes
        service = slot.parts.service
        if service.capabilities:
            entry["capabilities"] = list(service.capabilities)
        info = getattr(service, "context_info", None)
        if callable(info):  # the trained context and the like, where the service says
            entry.update(info())
    return entry


def make_router(registry: ModelRegistry, ctx_size: int) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [model_entry(s, ctx_size) for s in registry.slots.values()]
        return {"object": "list", "data": data}

    @router.post("/v1/models/load")
    async def load(request: Request) -> dict[str, Any]:
        body = await parse_body(request, ModelAction)
        keep_alive = parse_keep_alive(body.keep_alive)
        slot = await registry.acquire(body.model, keep_alive, serves=None)
        registry.release(slot)
        return {"model": slot.id, "status": slot.state}

    @router.post("/v1/models/unload")
    async def unload(request: Request) -> dict[str, Any]:
        body = await parse_body(request, ModelAction)
        status = await registry.unload(body.model)
        return {"model": registry.slot(body.model).id, "status": status}

    @router.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict[str, Any]:
        per_model = {s.id: _health(s) for s in registry.slots.values()}
        return {
            "status": "ok",
            "active": sum(m.get("active", 0) for m in per_model.values()),
            "queued": sum(m.get("queued", 0) for m in per_model.values()),
            "models": per_model,
        }

    return router


def _health(slot: Slot) -> dict[str, Any]:
    out: dict[str, Any] = {"status": slot.state}
    if slot.state == LOADED and slot.parts is not None:
        engine: EngineLike = slot.parts.engine
        out.update(
            active=engine.active_count, queued=engine.queue_depth, memory_bytes=slot.memory_bytes
        )
        # whether its prefix cache has a disk tier, and why not
        out.update({k: v for k, v in engine.stats().items() if k in _DISK_STATE})
    return out


class ModelsCollector(Collector):
    """Per-model gauges, labelled by model id, read at scrape time."""

    def __init__(self, registry: ModelRegistry):
        self.registry = registry

    def collect(self) -> Iterable[Metric]:
        gauges = {
            "loaded": GaugeMetricFamily(
                "mlx_server_model_loaded", "1 while the model is loaded", labels=["model"]
            ),
            "memory": GaugeMetricFamily(
                "mlx_server_model_memory_bytes",
                "Memory counted for the model against --models-memory-gb",
                labels=["model"],
            ),
            "running": GaugeMetricFamily(
                "mlx_server_model_running_sequences",
                "The model's running sequences",
                labels=["model"],
            ),
            "queued": GaugeMetricFamily(
                "mlx_server_model_queue_depth", "Requests waiting on the model", labels=["model"]
            ),
        }
        loads = CounterMetricFamily("mlx_server_model_loads", "Model loads", labels=["model"])
        unloads = CounterMetricFamily("mlx_server_model_unloads", "Model unloads", labels=["model"])
        for slot in self.registry.slots.values():
            engine = slot.parts.engine if slot.parts is not None else None
            gauges["loaded"].add_metric([slot.id], 1 if slot.state == LOADED else 0)
            gauges["memory"].add_metric([slot.id], slot.memory_bytes)
            gauges["running"].add_metric([slot.id], engine.active_count if engine else 0)
            gauges["queued"].add_metric(
                [slot.id], (engine.queue_depth if engine else 0) + slot.waiting
            )
            loads.add_metric([slot.id], slot.loads)
            unloads.add_metric([slot.id], slot.unloads)
        yield from gauges.values()
        yield loads
        yield unloads
