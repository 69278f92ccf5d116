"""OpenAI routes: /v1/chat/completions and /v1/models."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from mlx_server.choices import DEFAULT_MAX_N, check_n, start_chat_choices
from mlx_server.logs import log
from mlx_server.protocols.openai.adapter import to_chat_request
from mlx_server.protocols.openai.choices import ChoicesEncoder
from mlx_server.protocols.openai.encoder import ChatEncoder
from mlx_server.protocols.openai.model_list import model_object
from mlx_server.protocols.openai.schemas import ChatCompletionRequest
from mlx_server.server.http import parse_body
from mlx_server.server.streaming import respond
from mlx_server.service import ChatService


def make_router(service: ChatService, *, vision: bool = False) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        entry = model_object(service.model_id, **service.context_info())
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
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        model = body.model or service.model_id
        if n > 1:
            gens = await start_chat_choices(service, chat, n)
            choices = ChoicesEncoder(gens[0].request_id, model, include_usage, chat.logprobs, n)
            return await respond(request, choices, gens, stream=body.stream)
        gen = await service.start(chat)
        enc = ChatEncoder(gen.request_id, model, include_usage, chat.logprobs)
        return await respond(request, enc, [gen], stream=body.stream)

    return router
