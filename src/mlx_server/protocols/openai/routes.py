"""OpenAI routes: /v1/chat/completions and /v1/models."""

from __future__ import annotations

import time
import traceback
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from mlx_server.choices import DEFAULT_MAX_N, check_n, start_chat_choices
from mlx_server.events import Finished
from mlx_server.logs import log
from mlx_server.protocols.openai.adapter import to_chat_request
from mlx_server.protocols.openai.choices import cancel_all, collect_choices, stream_choices
from mlx_server.protocols.openai.encoder import ChunkEncoder, MessageBuilder, completion_json, sse
from mlx_server.protocols.openai.errors import stream_error_frames
from mlx_server.protocols.openai.schemas import ChatCompletionRequest
from mlx_server.server.http import parse_body, respond
from mlx_server.service import ChatService, Generation


def make_router(service: ChatService, *, vision: bool = False) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        entry = {
            "id": service.model_id,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "mlx",
        }
        if service.capabilities:
            entry["capabilities"] = service.capabilities
        return {"object": "list", "data": [entry]}

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        chat = to_chat_request(body, vision=vision)
        tools = len(chat.tools or [])
        log(
            f"Request: model={body.model}, messages={len(chat.messages)}, stream={str(body.stream).lower()}, tools={tools}"
        )
        n = check_n(body.n, getattr(request.app.state, "max_n", DEFAULT_MAX_N))
        model = body.model or service.model_id
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if n > 1:
            gens = await start_chat_choices(service, chat, n)
            return await respond(
                request,
                stream=stream_choices(gens, model, include_usage) if body.stream else None,
                collect=lambda: collect_choices(gens, model, chat.logprobs),
                cancel=lambda: cancel_all(gens),
            )
        gen = await service.start(chat)
        return await respond(
            request,
            stream=_stream(gen, model, include_usage) if body.stream else None,
            collect=lambda: _collect(gen, model, chat.logprobs),
            cancel=gen.cancel,
        )

    return router


async def _collect(gen: Generation, model: str, want_logprobs: bool) -> dict[str, Any]:
    builder = MessageBuilder()
    created = int(time.time())
    async for ev in gen.events():
        if isinstance(ev, Finished):
            if ev.reason == "error":
                from mlx_server.errors import ServerError

                raise ServerError(ev.error or "generation failed")
            out = completion_json(gen.request_id, model, created, builder, ev, want_logprobs)
            msg = out["choices"][0]["message"]
            log(
                f"Response: {len(msg.get('content') or '')} chars, {len(msg.get('tool_calls') or [])} tool call(s), finish={out['choices'][0]['finish_reason']}"
            )
            return out
        builder.add(ev)
    raise RuntimeError("generation ended without a result")


async def _stream(gen: Generation, model: str, include_usage: bool) -> AsyncIterator[bytes]:
    enc = ChunkEncoder(gen.request_id, model)
    yield sse(enc.role())
    try:
        async for ev in gen.events():
            if isinstance(ev, Finished):
                if ev.reason == "error":
                    yield stream_error_frames(ev.error or "generation failed")
                    return
                if ev.reason == "cancelled":
                    log("Stream generation cancelled")
                yield sse(enc.final(ev, with_usage=not include_usage))
                if include_usage:
                    yield sse(enc.usage_chunk(ev))
                yield b"data: [DONE]\n\n"
                return
            chunk = enc.event(ev)
            if chunk is not None:
                yield sse(chunk)
    except Exception as e:  # an internal fault after the 200 went out
        traceback.print_exc()
        log(f"Error in SSE stream: {type(e).__name__}: {e}")
        yield stream_error_frames(f"internal error: {type(e).__name__}")
