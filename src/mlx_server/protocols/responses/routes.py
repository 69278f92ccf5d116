"""Responses API routes: create (streaming and not), retrieve, delete, cancel, input_items.

Errors raised here reach the app's handlers, which answer in OpenAI's envelope. A response
being generated is "live" (retrievable and cancellable by id, stored or not); when it ends
it is stored unless the request said ``store: false``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from mlx_server.errors import (
    ContextLengthExceeded,
    InvalidRequest,
    NotFound,
    UnsupportedFeature,
)
from mlx_server.logs import log
from mlx_server.protocols.responses.adapter import Adapted, to_chat_request
from mlx_server.protocols.responses.encoder import ResponseFrames
from mlx_server.protocols.responses.items import new_id
from mlx_server.protocols.responses.schemas import CreateResponseRequest
from mlx_server.protocols.responses.store import ResponseStore, StoredResponse
from mlx_server.protocols.responses.stream import ResponseEncoder
from mlx_server.registry.lease import Models
from mlx_server.server.http import parse_and_lease
from mlx_server.server.streaming import respond
from mlx_server.service import ChatService, Generation


@dataclass
class Run:
    """One response being generated."""

    enc: ResponseEncoder
    gen: Generation
    service: ChatService  # the model it runs on
    adapted: Adapted
    history: list[dict[str, Any]]
    keep: bool
    done: asyncio.Event = field(default_factory=asyncio.Event)


def make_router(
    models: Models, *, vision: bool, store: ResponseStore, keepalive_s: float
) -> APIRouter:
    """The Responses API over ``models``; ``input_image`` parts are accepted if ``vision``;
    ``keepalive_s``: a stream's longest silence."""
    router = APIRouter()
    responses = Responses(vision, store)

    @router.post("/v1/responses")
    async def create(request: Request) -> Response:
        body, service = await parse_and_lease(request, CreateResponseRequest, models.chat)
        run = await responses.start(service, body)
        return await respond(
            request,
            ResponseFrames(run.enc),
            [run.gen],
            stream=body.stream,
            keepalive_s=keepalive_s,
            on_end=lambda: responses.end(run),
        )

    @router.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> dict[str, Any]:
        return responses.lookup(response_id)

    @router.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict[str, Any]:
        responses.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> dict[str, Any]:
        return await responses.cancel(response_id)

    @router.get("/v1/responses/{response_id}/input_items")
    async def input_items(
        response_id: str, limit: int = 20, order: str = "desc", after: str | None = None
    ) -> dict[str, Any]:
        return responses.input_items(response_id, limit, order, after)

    return router


class Responses:
    """The state behind the routes: live runs and the store."""

    def __init__(self, vision: bool, store: ResponseStore):
        self.vision = vision
        self.store = store
        self.live: dict[str, Run] = {}

    # ---- create --------------------------------------------------------------------------

    async def start(self, service: ChatService, body: CreateResponseRequest) -> Run:
        if body.background:
            raise UnsupportedFeature(
                "background responses are not supported; use stream or a plain request",
                param="background",
            )
        history: list[dict[str, Any]] = []
        if body.previous_response_id:
            prev = self.store.get(body.previous_response_id)
            if prev is None:
                raise InvalidRequest(
                    f"Previous response with id '{body.previous_response_id}' not found.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            history = prev.conversation
        adapted = to_chat_request(body, history, vision=self.vision)
        chat = adapted.chat
        log(
            f"Request: model={body.model}, responses, items={len(adapted.input_items)}, "
            f"history={len(history)}, stream={str(body.stream).lower()}, "
            f"tools={len(chat.tools or [])}"
        )
        rid = new_id("resp")
        try:
            gen = await service.start(chat, request_id=rid)
        except ContextLengthExceeded as e:
            raise e.with_param("input") from e
        base = self._base(body, adapted, service.model_id)
        enc = ResponseEncoder(rid, base, lambda text: _count_tokens(service, text))
        run = Run(enc, gen, service, adapted, history, keep=body.store is not False)
        self.live[rid] = run
        return run

    def _base(self, body: CreateResponseRequest, adapted: Adapted, model_id: str) -> dict[str, Any]:
        """The request-derived fields of the response object."""
        fmt: dict[str, Any] = {"type": "text"}
        if body.text is not None and body.text.format is not None:
            fmt = body.text.format.model_dump(by_alias=True, exclude_none=True)
            if fmt["type"] == "json_schema":
                fmt.setdefault("name", "response")
                fmt.setdefault("strict", False)
        reasoning = body.reasoning
        summary = reasoning.summary if reasoning is not None else None
        base = {
            "model": body.model or model_id,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "parallel_tool_calls": adapted.chat.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {
                "effort": reasoning.effort if reasoning is not None else None,
                "summary": summary if summary in ("auto", "concise", "detailed") else None,
            },
            "store": body.store is not False,
            "temperature": adapted.chat.sampling.temperature,
            "text": {"format": fmt},
            "tool_choice": adapted.tool_choice,
            "tools": adapted.tools,
            "top_p": adapted.chat.sampling.top_p,
            "truncation": "disabled",
            "background": False,
        }
        if body.user is not None:
            base["user"] = body.user
        return base

    def end(self, run: Run) -> None:
        """Forget the live run; store it (a run cut short by its client as cancelled)."""
        enc = run.enc
        enc.abandon()
        kinds = ", ".join(item["type"] for item in enc.output) or "none"
        log(f"Response: {enc.id} {enc.status}, output [{kinds}]")
        self.live.pop(enc.id, None)
        run.done.set()
        if not run.keep:
            return
        response = enc.response()
        conversation = [*run.history, *run.adapted.input_items, *response["output"]]
        self.store.put(StoredResponse(response, run.adapted.input_items, conversation))

    # ---- retrieve, delete, cancel, list --------------------------------------------------

    def lookup(self, rid: str) -> dict[str, Any]:
        run = self.live.get(rid)
        if run is not None:
            return run.enc.response()
        entry = self.store.get(rid)
        if entry is None:
            raise _not_found(rid)
        return entry.response

    def delete(self, rid: str) -> None:
        run = self.live.get(rid)
        if run is not None:
            run.keep = False
            run.gen.cancel()
            return
        if not self.store.delete(rid):
            raise _not_found(rid)

    async def cancel(self, rid: str) -> dict[str, Any]:
        """Cancel a live response (the engine stops it at its next step) and return it."""
        run = self.live.get(rid)
        if run is None:
            return self.lookup(rid)  # already ended: unchanged
        run.gen.cancel()
        run.service.engine.cancel(rid)
        try:
            await asyncio.wait_for(run.done.wait(), timeout=30)
        except asyncio.TimeoutError:
            pass
        return run.enc.response()

    def input_items(self, rid: str, limit: int, order: str, after: str | None) -> dict[str, Any]:
        if not 1 <= limit <= 100:
            raise InvalidRequest("limit must be between 1 and 100", param="limit")
        if order not in ("asc", "desc"):
            raise InvalidRequest("order must be 'asc' or 'desc'", param="order")
        run = self.live.get(rid)
        entry = self.store.get(rid)
        if run is not None:
            items = run.adapted.input_items
        elif entry is not None:
            items = entry.input_items
        else:
            raise _not_found(rid)
        items = list(reversed(items)) if order == "desc" else list(items)
        if after is not None:
            ids = [it["id"] for it in items]
            if after not in ids:
                raise InvalidRequest(f"no input item with id '{after}'", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else "",
            "last_id": page[-1]["id"] if page else "",
            "has_more": len(items) > limit,
        }


def _count_tokens(service: ChatService, text: str) -> int:
    return len(service.tokenizer.encode(text, add_special_tokens=False))


def _not_found(rid: str) -> NotFound:
    return NotFound(f"Response with id '{rid}' not found.", param="response_id")
