"""Ollama's routes: ``/api/chat``, ``/api/generate``, the model routes (``/api/tags``,
``/api/show``, ``/api/ps``, ``/api/version``) and the model-management ones this server
does not do (``/api/pull``, ``/api/delete``, ``/api/create``, ...), which answer an error
that says what to do instead. Errors are ``{"error": "..."}`` (``errors.py``); a failure
after the stream began is an ``{"error": ...}`` line."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from mlx_server.errors import InvalidRequest
from mlx_server.logs import log
from mlx_server.models.text_prompt import fim_stop_strings
from mlx_server.protocols.ollama import views
from mlx_server.protocols.ollama.adapter import (
    generate_chat_request,
    text_options,
    to_chat_request,
)
from mlx_server.protocols.ollama.embed import make_router as embed_router
from mlx_server.protocols.ollama.encoder import Clock, OllamaEncoder
from mlx_server.protocols.ollama.schemas import ChatBody, GenerateBody, ModelBody
from mlx_server.registry.keep_alive import parse_keep_alive
from mlx_server.registry.lease import Models
from mlx_server.server.framing import NDJSON
from mlx_server.server.http import parse_and_lease, parse_body
from mlx_server.server.streaming import respond
from mlx_server.service import ChatService, Generation
from mlx_server.service.text_completion import CompletionService

# The Ollama version /api/version reports: one recent enough that clients which compare
# versions send the fields served here (think, tools, format with a schema, logprobs).
OLLAMA_VERSION = "0.12.6"

B = TypeVar("B", ChatBody, GenerateBody)
_MANAGEMENT = ("/api/pull", "/api/push", "/api/delete", "/api/create", "/api/copy")


def make_router(models: Models, *, vision: bool, keepalive_s: float) -> APIRouter:
    """Ollama's API over ``models``; ``images`` are accepted if ``vision``; ``keepalive_s``:
    a stream's longest silence."""
    router = APIRouter()

    async def opening(request: Request, schema: type[B]) -> tuple[B, ChatService, Clock]:
        """The body, the chat model it names (leased) and the clock since it arrived."""
        arrived = time.perf_counter_ns()
        body, service = await parse_and_lease(request, schema, models.chat)
        return body, service, Clock(arrived)  # loaded: now

    async def answer(
        request: Request, body: ChatBody | GenerateBody, gen: Generation, clock: Clock
    ) -> Response:
        enc = OllamaEncoder(body.model, clock, chat=isinstance(body, ChatBody))
        return await respond(
            request, enc, [gen], stream=body.stream, keepalive_s=keepalive_s, framing=NDJSON
        )

    @router.post("/api/chat")
    async def chat(request: Request) -> Response:
        body, service, clock = await opening(request, ChatBody)
        if not body.messages:  # Ollama's way to load a model (or unload it: keep_alive 0)
            return _loaded(body.model, body.keep_alive, chat=True, clock=clock)
        neutral = to_chat_request(body, vision=vision)
        log(f"Request: ollama chat, model={body.model}, messages={len(neutral.messages)}")
        return await answer(request, body, await service.start(neutral, _request_id()), clock)

    @router.post("/api/generate")
    async def generate(request: Request) -> Response:
        body, service, clock = await opening(request, GenerateBody)
        if not body.prompt and not body.images and body.suffix is None:
            return _loaded(body.model, body.keep_alive, chat=False, clock=clock)
        log(f"Request: ollama generate, model={body.model}, raw={str(body.raw).lower()}")
        if body.raw or body.suffix is not None:
            gen = await _start_text(CompletionService(service), body)
        else:
            neutral = generate_chat_request(body, vision=vision)
            gen = await service.start(neutral, request_id=_request_id())
        return await answer(request, body, gen, clock)

    router.include_router(listing_router(models))

    async def manage(request: Request) -> None:
        raise InvalidRequest(_management_message(request.url.path), code="not_supported")

    for path in _MANAGEMENT:
        router.add_api_route(path, manage, methods=["POST", "DELETE"])
    router.include_router(embed_router(models))
    return router


def listing_router(models: Models) -> APIRouter:
    """What Ollama's clients ask before they use a model (``/api/tags``, ``/api/ps``,
    ``/api/show``, ``/api/version``): on a chat server, and on an embedding model's, whose
    clients (``/api/embed``) check them too."""
    router = APIRouter()

    @router.get("/api/tags")
    async def tags() -> dict[str, Any]:
        return {"models": [views.tag_entry(v) for v in views.views(models)]}

    @router.get("/api/ps")
    async def ps() -> dict[str, Any]:
        loaded = [v for v in views.views(models) if v.loaded]
        return {"models": [views.ps_entry(v) for v in loaded]}

    @router.post("/api/show")
    async def show(request: Request) -> dict[str, Any]:
        body = await parse_body(request, ModelBody)
        return views.show(views.find(models, body.model_name))

    @router.get("/api/version")
    async def version() -> dict[str, Any]:
        return {"version": OLLAMA_VERSION}

    return router


def _request_id() -> str:
    return f"ollama-{uuid.uuid4().hex[:24]}"


async def _start_text(completions: CompletionService, body: GenerateBody) -> Generation:
    """A raw prompt, or fill-in-the-middle with ``suffix``, through the text completions."""
    opts = text_options(body)
    if body.suffix is not None:  # stop where the model leaves the hole it fills
        opts = replace(opts, stop=opts.stop + fim_stop_strings(completions.tokenizer))
    prompts = await completions.prepare([body.prompt or ""], body.suffix, opts.max_tokens)
    grammars = await completions.grammars(opts, len(prompts))  # ``format``
    return completions.start(prompts, opts, _request_id(), grammars)[0]


def _loaded(model: str, keep_alive: Any, *, chat: bool, clock: Clock) -> Response:
    """The answer to a request with nothing to generate: the model is loaded (the lease
    did it), or unloaded after this request when ``keep_alive`` is 0."""
    reason = "unload" if parse_keep_alive(keep_alive) == 0 else "load"
    enc = OllamaEncoder(model, clock, chat=chat)
    body = enc.done(reason)
    if chat:
        body["message"] = {"role": "assistant", "content": ""}
    return JSONResponse(body)


def _management_message(path: str) -> str:
    what = path.removeprefix("/api/")
    if what == "pull":
        return (
            "pull is not supported: mlx-server serves the models it was started with "
            "(--model, --models-dir); a Hugging Face id given to --model is downloaded at start"
        )
    return (
        f"{what} is not supported: mlx-server does not manage a model store; put MLX models "
        "in the folder given to --models-dir, or start it with --model"
    )
