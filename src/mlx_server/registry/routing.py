"""The routing service: what the protocol routes get in place of one model's ChatService,
the same interface, each call going to the model the request named.

A request names its model in its body's ``model`` field. ``parse_body`` hands every parsed
body to ``bind`` (the app's ``bind_model``), which leases that model (loading it if need be)
for the request; ``RequestLeases`` (ASGI middleware) gives the leases back once the response
has ended, streams included."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, TypeVar

from mlx_server.engine.core.handle import GenerationHandle
from mlx_server.engine.core.protocol import EngineLike
from mlx_server.errors import InvalidRequest, Overloaded
from mlx_server.registry.keep_alive import parse_keep_alive
from mlx_server.registry.registry import ModelRegistry, Slot
from mlx_server.types import GenerationRequest

Scope = dict[str, Any]
T = TypeVar("T")


@dataclass
class _Leases:
    """The models one request holds; the last one bound is the one it uses."""

    slots: list[Slot] = field(default_factory=list)


_request: ContextVar[_Leases | None] = ContextVar("mlx_server_model_leases", default=None)


class RequestLeases:
    """Raw ASGI middleware: a request's model leases live until its response has ended."""

    def __init__(self, app: Any, registry: ModelRegistry):
        self.app = app
        self.registry = registry

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        leases = _Leases()
        token = _request.set(leases)
        try:
            await self.app(scope, receive, send)
        finally:
            _request.reset(token)
            for slot in leases.slots:
                self.registry.release(slot)


def binder(registry: ModelRegistry) -> Any:
    """``app.state.bind_model``: lease the body's model for the request. Bodies of schemas
    without a ``model`` field (``/v1/cancel``) bind only when they name one; schemas that
    manage models themselves set ``binds_model = False``; those of routes served by
    embedding models set ``serves = "embedding"``."""

    async def bind(request: Any, schema: Any, obj: dict[str, Any]) -> None:
        if not getattr(schema, "binds_model", True):
            return
        if "model" not in obj and "model" not in getattr(schema, "model_fields", {}):
            return
        leases = _request.get()
        if leases is None:  # outside RequestLeases: nothing would give the lease back
            return
        name = obj.get("model")
        keep_alive = parse_keep_alive(obj.get("keep_alive"))
        serves = getattr(schema, "serves", "chat")  # the embeddings and rerank bodies say
        slot = await registry.acquire(name if isinstance(name, str) else "", keep_alive, serves)
        leases.slots.append(slot)

    return bind


def current_slot(registry: ModelRegistry) -> Slot:
    """The model this request bound; without one, the default model when it is loaded."""
    leases = _request.get()
    if leases is not None and leases.slots:
        return leases.slots[-1]
    slot = registry.slot("")
    if slot.state != "loaded":
        raise Overloaded(
            f"no model named in the request and the default model '{slot.id}' is not loaded; "
            "name one in the body's model field"
        )
    return slot


def request_model_id(registry: ModelRegistry) -> str:
    """The request's model; outside a request (routers being built), the default's."""
    leases = _request.get()
    if leases is not None and leases.slots:
        return leases.slots[-1].id
    return registry.default_id


class RoutedService:
    """A ChatService's interface over the registry: each request's calls go to the
    service of the model it bound."""

    def __init__(self, registry: ModelRegistry):
        self.registry = registry
        self.engine: EngineLike = RoutedEngine(registry)  # install_metrics wraps it

    def _service(self) -> Any:
        return current_slot(self.registry).parts.service

    @property
    def model_id(self) -> str:
        return request_model_id(self.registry)

    @property
    def tokenizer(self) -> Any:
        """The request's model's tokenizer; outside a request, one that looks the model up
        per call (for routers that keep the tokenizer, such as /tokenize's)."""
        leases = _request.get()
        if leases is not None and leases.slots:
            return leases.slots[-1].parts.service.tokenizer
        return _RoutedTokenizer(self)

    @property
    def capabilities(self) -> list[str]:
        return list(self._service().capabilities)

    async def start(self, chat: Any, request_id: str | None = None) -> Any:
        return await self._checked(chat).start(chat, request_id=request_id)

    async def count(self, chat: Any) -> int:
        return int(await self._checked(chat).count(chat))

    def _checked(self, chat: Any) -> Any:
        """The request's service; media parts (the routes take them when any offered model
        is a vision model) are a 400 for a text-only one."""
        service = self._service()
        if service.vision is None:
            for m in chat.messages:
                content = m.get("content")
                for part in content if isinstance(content, list) else []:
                    if part.get("type") != "text":
                        where = part.get("param") or "messages"
                        raise InvalidRequest(
                            f"{where} is an {part.get('type')} part, but model "
                            f"'{service.model_id}' accepts text only",
                            param=where,
                        )
        return service

    def __getattr__(self, name: str) -> Any:  # the rest of ChatService's interface
        return getattr(self._service(), name)


class RoutedEmbeddings:
    """An EmbeddingService's interface over the registry, for the embeddings and rerank
    routes: each request's calls go to the embedding model it bound (its body's schema
    says ``serves = "embedding"``, so the binder refuses any other kind)."""

    def __init__(self, registry: ModelRegistry):
        self.registry = registry

    @property
    def model_id(self) -> str:
        return request_model_id(self.registry)

    def __getattr__(self, name: str) -> Any:  # embed, rerank, kind, capabilities ...
        return getattr(current_slot(self.registry).parts.service, name)


class _RoutedTokenizer:
    def __init__(self, service: RoutedService):
        self._routed = service

    def __getattr__(self, name: str) -> Any:
        return getattr(self._routed._service().tokenizer, name)


class RoutedEngine:
    """The engine interface over every loaded model's engine: submissions go to the
    request's model, counts and cancellation span them all."""

    def __init__(self, registry: ModelRegistry):
        self.registry = registry

    def _engines(self) -> list[EngineLike]:
        return [s.parts.engine for s in self.registry.loaded() if s.parts is not None]

    def _request_engine(self) -> EngineLike:
        engine: EngineLike = current_slot(self.registry).parts.engine
        return engine

    def start(self) -> None:
        """Each model's engine starts as it loads."""

    def submit(
        self, req: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None
    ) -> GenerationHandle:
        return self._request_engine().submit(req, loop)

    def call(self, fn: Callable[[], T]) -> Future[T]:
        return self._request_engine().call(fn)

    def cancel(self, request_id: str | None = None) -> int:
        return sum(e.cancel(request_id) for e in self._engines())

    @property
    def active_count(self) -> int:
        return sum(e.active_count for e in self._engines())

    @property
    def queue_depth(self) -> int:
        return sum(e.queue_depth for e in self._engines())

    @property
    def config(self) -> Any:
        budgets = [
            getattr(getattr(e, "config", None), "kv_budget_bytes", 0) for e in self._engines()
        ]
        return SimpleNamespace(kv_budget_bytes=sum(budgets))

    def stats(self) -> dict[str, Any]:
        """The numeric stats of every loaded engine, summed."""
        out: dict[str, Any] = {}
        for e in self._engines():
            for k, v in e.stats().items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    out[k] = out.get(k, 0) + v
        return out

    def shutdown(self, timeout: float = 3.0) -> None:
        self.registry.shutdown(timeout)
