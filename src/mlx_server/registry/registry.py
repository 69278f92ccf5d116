"""The models a server offers and which of them are loaded: loads on request (one load at a
time per model, off the event loop), unloads by an LRU memory budget, a cap on how many are
loaded, idle time and ``keep_alive``; pinned models stay. A model serving requests is never
unloaded under them: every request holds a lease on its model until its response ends."""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_server.errors import InvalidRequest, NotFound, Overloaded, article
from mlx_server.logs import log
from mlx_server.models.memory_plan import weights_bytes
from mlx_server.registry.catalog import Offer

UNLOADED, LOADING, LOADED = "unloaded", "loading", "loaded"


@dataclass
class Slot:
    """One offered model and its loaded state (its ModelParts while loaded)."""

    offer: Offer
    pinned: bool = False
    state: str = UNLOADED
    parts: Any = None
    memory_bytes: int = 0  # counted against the budget while loading or loaded
    leases: int = 0  # requests that hold the model (they are running or about to)
    waiting: int = 0  # requests waiting for its load
    last_used: float = 0.0
    keep_alive: float | None = None  # the last request's keep_alive; None: the server's
    # an unload was asked while it loaded or served: it goes once idle, whatever keep_alive
    # the requests under way (those waiting for the load among them) gave
    unload_asked: bool = False
    loads: int = 0
    unloads: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def id(self) -> str:
        return self.offer.id

    @property
    def busy(self) -> bool:
        if self.leases:
            return True
        engine = self.parts.engine if self.parts is not None else None
        return engine is not None and bool(engine.active_count or engine.queue_depth)


@dataclass(frozen=True)
class Limits:
    memory_bytes: int  # the budget for loaded models
    max_loaded: int  # 0: no cap
    idle_s: float  # 0: never unloaded for idleness
    max_waiting: int  # requests allowed to wait for one model's load
    overhead_bytes: int  # per loaded model besides its weights: its KV budget


class ModelRegistry:
    """Offered models by id; ``loader(offer)`` loads one (in a worker thread) and returns
    its ModelParts."""

    def __init__(
        self,
        offers: list[Offer],
        limits: Limits,
        loader: Callable[[Offer], Any],
        *,
        pinned: tuple[str, ...] = (),
        clock: Callable[[], float] = time.monotonic,
    ):
        self.slots = {o.id: Slot(o, pinned=o.id in pinned) for o in offers}
        self.default_id = offers[0].id
        self.limits = limits
        self.loader = loader
        self.clock = clock
        self._room = asyncio.Lock()  # one eviction decision at a time
        self._reaper: asyncio.Task[None] | None = None

    # ---- lookup ------------------------------------------------------------------------

    def slot(self, model_id: str, serves: str | None = None) -> Slot:
        """The slot of ``model_id`` (empty: the default model; for a request that needs a
        kind, ``serves``, the first offered of that kind when the default is not); unknown:
        404 model_not_found. Ollama's clients name a model with a tag: ``<id>:latest`` is
        ``<id>``."""
        slot = self.slots.get(model_id or self._default_for(serves))
        if slot is None and model_id.endswith(":latest"):
            slot = self.slots.get(model_id.removesuffix(":latest"))
        if slot is None:
            offered = ", ".join(self.slots)
            raise NotFound(
                f"model '{model_id}' not found; offered: {offered}",
                param="model",
                code="model_not_found",
            )
        return slot

    def _default_for(self, serves: str | None) -> str:
        """The default model, or where it does not serve ``serves`` the first offer that
        does (``--models-dir`` lists by name: an embedding model may come first). Among
        encoder models, a rerank request prefers the first reranker, an embeddings request
        the first embedder."""
        if serves is None:
            return self.default_id
        order = [self.default_id, *(i for i in self.slots if i != self.default_id)]
        fits = [i for i in order if _serves(self.slots[i], serves)]
        if serves in ENCODER_TASKS and len(fits) > 1:
            ranks = serves == "rerank"
            best = (i for i in fits if _ranks(self.slots[i].offer.path) == ranks)
            return next(best, fits[0])
        return fits[0] if fits else self.default_id

    def loaded(self) -> list[Slot]:
        return [s for s in self.slots.values() if s.state == LOADED]

    # ---- requests ----------------------------------------------------------------------

    async def acquire(
        self, model_id: str, keep_alive: float | None = None, serves: str | None = "chat"
    ) -> Slot:
        """Lease the model for a request, loading it first if need be. ``serves``: what the
        request needs, "chat" (text generation), "embedding" or "rerank" (an embedding-kind
        model; without ``model_id`` the first embedder or reranker); a model of the other
        kind is a 400 before anything loads; None: any model."""
        slot = self.slot(model_id, serves)
        if serves is not None:
            _check_serves(slot, serves)
        slot.leases += 1  # from here on it is not a candidate for unloading
        try:
            if slot.state != LOADED:
                await self._load_for(slot)
        except BaseException:
            slot.leases -= 1
            raise
        if not slot.unload_asked:
            slot.keep_alive = keep_alive
        slot.last_used = self.clock()
        self._ensure_reaper()
        return slot

    def release(self, slot: Slot) -> None:
        """A request's response ended."""
        slot.leases -= 1
        slot.last_used = self.clock()
        if slot.leases == 0 and slot.keep_alive == 0:
            self._ensure_reaper()

    async def _load_for(self, slot: Slot) -> None:
        if slot.waiting >= self.limits.max_waiting:
            raise Overloaded(f"too many requests are waiting for model '{slot.id}' to load")
        slot.waiting += 1
        try:
            async with slot.lock:  # one load at a time; the others find it loaded
                if slot.state != LOADED:
                    await self._load(slot)
        finally:
            slot.waiting -= 1

    # ---- loading and unloading ---------------------------------------------------------

    async def load(self, model_id: str) -> Slot:
        """Load a model (``POST /v1/models/load``); a loaded one is left as it is."""
        slot = await self.acquire(model_id, serves=None)
        self.release(slot)
        return slot

    def _overhead(self, slot: Slot) -> int:
        """Memory a model takes besides its weights: a chat model's KV budget; an encoder
        keeps no cache."""
        return 0 if slot.offer.kind == "embedding" else self.limits.overhead_bytes

    async def _load(self, slot: Slot) -> None:
        estimate = slot.offer.disk_bytes + self._overhead(slot)
        async with self._room:
            await self._make_room(slot, estimate)
            slot.state, slot.memory_bytes = LOADING, estimate
        log(f"Loading model {slot.id} from {slot.offer.path}")
        t0 = time.perf_counter()
        try:
            parts = await asyncio.to_thread(self.loader, slot.offer)
        except BaseException:
            slot.state, slot.memory_bytes, slot.unload_asked = UNLOADED, 0, False
            raise
        slot.parts, slot.state, slot.loads = parts, LOADED, slot.loads + 1
        slot.memory_bytes = weights_bytes(parts.loaded.model) + self._overhead(slot)
        log(
            f"Model {slot.id} loaded in {time.perf_counter() - t0:.2f}s "
            f"({slot.memory_bytes // (1 << 20)}MB counted)"
        )

    async def _make_room(self, slot: Slot, need: int) -> None:
        """Unload least recently used idle models until ``need`` bytes and one more model
        fit; with only busy or pinned models left, a load that still does not fit is a 503
        (unless nothing else is loaded: a model larger than the budget is served alone)."""
        while not self._fits(need):
            victims = [
                s
                for s in self.slots.values()
                if s.state == LOADED and s is not slot and not s.pinned and not s.busy
            ]
            if not victims:
                others = [s for s in self.slots.values() if s.state != UNLOADED and s is not slot]
                if not others:
                    log(f"Model {slot.id}: larger than --models-memory-gb, loaded alone")
                    return
                raise Overloaded(
                    f"no room to load model '{slot.id}': the loaded models "
                    f"({', '.join(s.id for s in others)}) are busy or pinned"
                )
            victim = min(victims, key=lambda s: s.last_used)
            log(f"Unloading model {victim.id} (least recently used) to make room for {slot.id}")
            await self._unload(victim)

    def _fits(self, need: int) -> bool:
        held = [s for s in self.slots.values() if s.state != UNLOADED]
        if self.limits.max_loaded and len(held) + 1 > self.limits.max_loaded:
            return False
        return sum(s.memory_bytes for s in held) + need <= self.limits.memory_bytes

    async def unload(self, model_id: str) -> str:
        """``POST /v1/models/unload``: unloaded now when idle, else after its requests end.
        Returns the model's status."""
        slot = self.slot(model_id)
        if slot.pinned:
            raise InvalidRequest(f"model '{slot.id}' is pinned (--pin)", param="model")
        if slot.state == UNLOADED:
            return UNLOADED
        if slot.busy or slot.state == LOADING:
            slot.keep_alive = 0  # the reaper unloads it once its requests end
            slot.unload_asked = True
            self._ensure_reaper()
            return slot.state
        await self._unload(slot)
        return slot.state

    async def _unload(self, slot: Slot) -> None:
        if slot.busy or slot.state != LOADED:
            return
        parts, slot.parts = slot.parts, None
        slot.state, slot.memory_bytes, slot.unloads = UNLOADED, 0, slot.unloads + 1
        slot.unload_asked = False
        # The engine writes its prefix cache to the disk tier (when on) as it stops.
        await asyncio.to_thread(_release_parts, parts)
        log(f"Model {slot.id} unloaded")

    # ---- time-based unloading ----------------------------------------------------------

    def expired(self, slot: Slot, now: float) -> bool:
        if slot.state != LOADED or slot.pinned or slot.busy:
            return False
        ttl = slot.keep_alive if slot.keep_alive is not None else self.limits.idle_s or math.inf
        return now - slot.last_used >= ttl

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        """Unload expired models; ends when nothing loaded can expire."""
        while True:
            now = self.clock()
            for slot in self.loaded():
                if self.expired(slot, now):
                    reason = "keep_alive" if slot.keep_alive is not None else "idle"
                    log(f"Unloading model {slot.id} ({reason})")
                    async with slot.lock:
                        await self._unload(slot)
            if not any(self._may_expire(s) for s in self.slots.values()):
                return
            await asyncio.sleep(0.1)

    def _may_expire(self, slot: Slot) -> bool:
        if slot.state == UNLOADED or slot.pinned:
            return False
        ttl = slot.keep_alive if slot.keep_alive is not None else self.limits.idle_s or math.inf
        return ttl != math.inf

    def shutdown(self, timeout: float) -> None:
        """Stop every loaded model's engine (on server shutdown; any thread)."""
        for slot in list(self.slots.values()):
            if slot.parts is not None:
                slot.parts.engine.shutdown(timeout)


ENCODER_TASKS = ("embedding", "rerank")  # what a request may need of an embedding-kind model


def _serves(slot: Slot, serves: str) -> bool:
    return (slot.offer.kind == "embedding") == (serves in ENCODER_TASKS)


@functools.lru_cache(maxsize=256)
def _ranks(path: str) -> bool:
    """Whether the encoder model at ``path`` is a reranker (read once per path)."""
    from mlx_server.models.embedding import ranks_documents

    return ranks_documents(Path(path))


def _check_serves(slot: Slot, serves: str) -> None:
    if not _serves(slot, serves):
        raise wrong_kind(slot.id, slot.offer.kind, "name an embedding model")


def wrong_kind(model_id: str, kind: str, instead: str = "") -> InvalidRequest:
    """The 400 for a request naming a model of the other kind: an embedding model (``kind``)
    where text is generated, or a chat model where embeddings are; ``instead``: what a chat
    model's caller should do."""
    if kind == "embedding":
        does = "it does not generate text (it serves /v1/embeddings or /v1/rerank)"
    else:
        does = f"it does not serve embeddings or rerank; {instead}"
    return InvalidRequest(
        f"the model '{model_id}' is {article(kind)} {kind} model; {does}",
        param="model",
        code="model_not_supported",
    )


def _release_parts(parts: Any) -> None:
    parts.engine.shutdown(3.0)
    del parts
    import gc

    gc.collect()
    try:
        import mlx.core as mx

        mx.clear_cache()
    except Exception:  # an MLX without clear_cache: its buffers are freed as they go
        pass
