"""Anthropic routes: /v1/messages and /v1/messages/count_tokens.

Errors raised here (InvalidRequest, Overloaded, ...) reach the app's handlers, which answer
with Anthropic's ``{"type": "error", "error": {...}}`` envelope on these paths. A failure
after a stream began is sent as an ``error`` event, and the stream ends.
"""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response

from mlx_server.errors import ContextLengthExceeded, ServerError
from mlx_server.events import Finished
from mlx_server.logs import log
from mlx_server.protocols.anthropic.adapter import to_chat_request
from mlx_server.protocols.anthropic.encoder import (
    MessageAccumulator,
    StreamEncoder,
    context_error_message,
    new_message_id,
    sse_frame,
)
from mlx_server.protocols.anthropic.errors import error_json
from mlx_server.protocols.anthropic.schemas import CountTokensRequest, MessagesRequest
from mlx_server.server.http import parse_body, respond
from mlx_server.service import ChatService, Generation
from mlx_server.types import ChatRequest

# A stream that has been silent this long gets a ``ping`` event. A long prompt's prefill can
# take minutes before the first token; clients and proxies drop a connection that stays
# quiet (Claude Code's HTTP client gives up after 5 minutes without a byte).
PING_INTERVAL_S = 15.0

T = TypeVar("T")


def make_router(service: ChatService, *, vision: bool = False) -> APIRouter:
    """The Anthropic Messages API over ``service``; image blocks are accepted if ``vision``."""
    router = APIRouter()

    @router.post("/v1/messages")
    async def messages(request: Request) -> Response:
        body = await parse_body(request, MessagesRequest)
        chat = to_chat_request(body, vision=vision)
        log(
            f"Request: model={body.model}, messages={len(chat.messages)}, "
            f"stream={str(body.stream).lower()}, tools={len(chat.tools or [])}"
        )
        message_id = new_message_id()
        gen = await _start(service, chat, message_id)
        enc = StreamEncoder(message_id, body.model, gen.prompt_tokens, gen.cached_tokens)
        return await respond(
            request,
            stream=_stream(gen, enc) if body.stream else None,
            collect=lambda: _collect(gen, enc),
            cancel=gen.cancel,
        )

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict[str, Any]:
        body = await parse_body(request, CountTokensRequest)
        chat = to_chat_request(body, vision=vision)
        return {"input_tokens": await service.count(chat)}

    return router


async def _start(service: ChatService, chat: ChatRequest, message_id: str) -> Generation:
    try:
        return await service.start(chat, request_id=message_id)
    except ContextLengthExceeded as e:
        n = await service.count(chat)
        message = context_error_message(n, chat.max_tokens or 0, service.ctx_size)
        raise ContextLengthExceeded(message, param=e.param) from e


async def _collect(gen: Generation, enc: StreamEncoder) -> dict[str, Any]:
    await gen.started()
    enc.cached_tokens = gen.cached_tokens
    acc = MessageAccumulator()
    for event in enc.start():
        acc.add(event)
    async for ev in gen.events():
        if isinstance(ev, Finished):
            if ev.reason == "error":
                raise ServerError(ev.error or "generation failed")
            for event in enc.finish(ev):
                acc.add(event)
            msg = acc.message
            kinds = ", ".join(b["type"] for b in msg["content"]) or "none"
            log(f"Response: blocks [{kinds}], stop_reason={msg['stop_reason']}")
            return msg
        for event in enc.event(ev):
            acc.add(event)
    raise RuntimeError("generation ended without a result")


async def _with_keepalive(
    events: AsyncIterator[T], interval: float
) -> AsyncGenerator[T | None, None]:
    """``events``, with a None each time ``interval`` seconds pass without one. Closing
    this closes ``events`` (a generation's cleanup frees its slot)."""
    pending: asyncio.Future[T] = asyncio.ensure_future(anext(events))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield None
                continue
            try:
                ev = pending.result()
            except StopAsyncIteration:
                return
            yield ev
            pending = asyncio.ensure_future(anext(events))
    finally:
        if pending.done():
            close = getattr(events, "aclose", None)
            if close is not None:
                await close()
        else:
            pending.cancel()  # raised inside ``events``, whose cleanup then runs


async def _stream(gen: Generation, enc: StreamEncoder) -> AsyncIterator[bytes]:
    # message_start reports the prompt's cache split, known once the engine starts it.
    await gen.started()
    enc.cached_tokens = gen.cached_tokens
    for event in enc.start():
        yield sse_frame(event)
    events = _with_keepalive(gen.events(), PING_INTERVAL_S)
    try:
        async for ev in events:
            if ev is None:
                yield sse_frame({"type": "ping"})
                continue
            if isinstance(ev, Finished):
                if ev.reason == "error":
                    yield sse_frame(error_json("api_error", ev.error or "generation failed"))
                    return
                if ev.reason == "cancelled":
                    log("Stream generation cancelled")
                for event in enc.finish(ev):
                    yield sse_frame(event)
                return
            for event in enc.event(ev):
                yield sse_frame(event)
    except Exception as e:  # an internal fault after the 200 went out
        traceback.print_exc()
        log(f"Error in SSE stream: {type(e).__name__}: {e}")
        yield sse_frame(error_json("api_error", f"internal error: {type(e).__name__}"))
    finally:
        await events.aclose()
