"""OpenAI Chat Completions: ``POST /v1/chat/completions``, and
``POST /v1/chat/completions/count_tokens``, a chat request's prompt size without generating.

OpenAI's API has no count endpoint for chat; the path mirrors Anthropic's
``/v1/messages/count_tokens`` (the same idea under the endpoint it measures for), and the
answer takes the shape of OpenAI's own input-token count for the Responses API
(``{"object": ..., "input_tokens": N}``). ``input_tokens`` equals the ``usage.prompt_tokens``
that the same request body gets from ``/v1/chat/completions``: messages, tools,
``tool_choice`` and ``chat_template_kwargs`` all count.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from mlx_server.logs import log
from mlx_server.protocols.openai.chat.adapter import to_chat_request
from mlx_server.protocols.openai.chat.encoder import ChatEncoder, ChoicesEncoder
from mlx_server.protocols.openai.chat.schemas import ChatCompletionRequest
from mlx_server.registry.lease import Models
from mlx_server.server.http import parse_and_lease
from mlx_server.server.streaming import respond
from mlx_server.service.choices import check_n, start_chat_choices


def make_router(models: Models, *, vision: bool, max_n: int, keepalive_s: float) -> APIRouter:
    """``vision``: media parts are taken (a model that takes images is served); ``max_n``:
    the most choices a request may ask for; ``keepalive_s``: a stream's longest silence."""
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body, service = await parse_and_lease(request, ChatCompletionRequest, models.chat)
        chat = to_chat_request(body, vision=vision)
        tools = len(chat.tools or [])
        log(
            f"Request: model={body.model}, messages={len(chat.messages)}, stream={str(body.stream).lower()}, tools={tools}"
        )
        n = check_n(body.n, max_n)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        model = body.model or service.model_id
        if n > 1:
            gens = await start_chat_choices(service, chat, n)
            choices = ChoicesEncoder(gens[0].request_id, model, include_usage, chat.logprobs, n)
            return await respond(
                request, choices, gens, stream=body.stream, keepalive_s=keepalive_s
            )
        gen = await service.start(chat)
        enc = ChatEncoder(gen.request_id, model, include_usage, chat.logprobs)
        return await respond(request, enc, [gen], stream=body.stream, keepalive_s=keepalive_s)

    @router.post("/v1/chat/completions/count_tokens")
    async def count_tokens(request: Request) -> dict[str, Any]:
        body, service = await parse_and_lease(request, ChatCompletionRequest, models.chat)
        chat = to_chat_request(body, vision=vision)
        n = await service.count(chat)
        return {"object": "chat.completion.input_tokens", "input_tokens": n}

    return router
