"""``POST /v1/chat/completions/count_tokens``: a chat request's prompt size, without generating.

OpenAI's API has no such endpoint for chat; the path mirrors Anthropic's
``/v1/messages/count_tokens`` (the same idea under the endpoint it measures for), and the
answer takes the shape of OpenAI's own input-token count for the Responses API
(``{"object": ..., "input_tokens": N}``). ``input_tokens`` equals the ``usage.prompt_tokens``
that the same request body gets from ``/v1/chat/completions``: messages, tools,
``tool_choice`` and ``chat_template_kwargs`` all count.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from mlx_server.protocols.openai.adapter import to_chat_request
from mlx_server.protocols.openai.schemas import ChatCompletionRequest
from mlx_server.registry.lease import Models
from mlx_server.server.http import parse_body


def make_router(models: Models, *, vision: bool) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions/count_tokens")
    async def count_tokens(request: Request) -> dict[str, Any]:
        body = await parse_body(request, ChatCompletionRequest)
        service = await models.chat(request, body.model, body.keep_alive)
        chat = to_chat_request(body, vision=vision)
        n = await service.count(chat)
        return {"object": "chat.completion.input_tokens", "input_tokens": n}

    return router
