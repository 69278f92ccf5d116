"""Routes of a server with several models: loading and unloading on demand, and per-model
gauges on ``/metrics``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import APIRouter, Request
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict

from mlx_server.registry.keep_alive import KeepAliveField, parse_keep_alive
from mlx_server.registry.registry import LOADED, ModelRegistry
from mlx_server.server.http import parse_body


class ModelAction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    keep_alive: KeepAliveField = None


def make_router(registry: ModelRegistry) -> APIRouter:
    """Loading and unloading on demand (the listing and ``/health`` are the app's, through
    ``RegistryModels``)."""
    router = APIRouter()

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

    return router


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
