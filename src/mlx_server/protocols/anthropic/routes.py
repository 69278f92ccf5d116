"""Anthropic routes: /v1/messages and /v1/messages/count_tokens.

Errors raised here (InvalidRequest, Overloaded, ...) reach the app's handlers, which answer
with Anthropic's ``{"type": "error", "error": {...}}`` envelope on these paths. A failure
after a stream began is sent as an ``error`` event (and Jan's ``error:`` line), and the
stream ends.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from mlx_server.errors import ContextLengthExceeded
from mlx_server.logs import log
from mlx_server.protocols.anthropic.adapter import to_chat_request
from mlx_server.protocols.anthropic.encoder import MessagesEncoder
from mlx_server.protocols.anthropic.errors import context_error_message
from mlx_server.protocols.anthropic.schemas import CountTokensRequest, MessagesRequest
from mlx_server.protocols.anthropic.stream import StreamEncoder, new_message_id
from mlx_server.registry.lease import Models
from mlx_server.server.http import parse_and_lease
from mlx_server.server.streaming import respond
from mlx_server.service import ChatService, Generation
from mlx_server.types import ChatRequest


def make_router(models: Models, *, vision: bool, keepalive_s: float) -> APIRouter:
    """The Anthropic Messages API over ``models``; image blocks are accepted if ``vision``;
    ``keepalive_s``: a stream's longest silence."""
    router = APIRouter()

    @router.post("/v1/messages")
    async def messages(request: Request) -> Response:
        body, service = await parse_and_lease(request, MessagesRequest, models.chat)
        chat = to_chat_request(body, vision=vision)
        log(
            f"Request: model={body.model}, messages={len(chat.messages)}, "
            f"stream={str(body.stream).lower()}, tools={len(chat.tools or [])}"
        )
        message_id = new_message_id()
        gen = await _start(service, chat, message_id)
        enc = MessagesEncoder(StreamEncoder(message_id, body.model, gen.prompt_tokens))
        return await respond(request, enc, [gen], stream=body.stream, keepalive_s=keepalive_s)

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict[str, Any]:
        body, service = await parse_and_lease(request, CountTokensRequest, models.chat)
        chat = to_chat_request(body, vision=vision)
        return {"input_tokens": await service.count(chat)}

    return router


async def _start(service: ChatService, chat: ChatRequest, message_id: str) -> Generation:
    try:
        return await service.start(chat, request_id=message_id)
    except ContextLengthExceeded as e:
        # Anthropic's wording first (Claude Code compacts or lowers max_tokens on it), then
        # the sentence other clients' detectors look for.
        message = context_error_message(e.n_prompt_tokens, chat.max_tokens or 0, e.n_ctx)
        raise e.with_param(e.param, f"{message}; {e.message}") from e
