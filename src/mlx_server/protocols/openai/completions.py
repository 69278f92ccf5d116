"""OpenAI legacy Completions: ``POST /v1/completions`` (raw prompts, fill-in-the-middle)."""

from __future__ import annotations

import traceback
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from mlx_server.choices import DEFAULT_MAX_N, check_n, merged_choices, start_text_choices
from mlx_server.errors import InvalidRequest, ServerError
from mlx_server.events import Finished, Usage
from mlx_server.logs import log
from mlx_server.models.text_prompt import fim_stop_strings
from mlx_server.protocols.openai.adapter import sampling_params
from mlx_server.protocols.openai.completions_encoder import CompletionEncoder
from mlx_server.protocols.openai.completions_schema import CompletionRequest
from mlx_server.protocols.openai.encoder import sse
from mlx_server.protocols.openai.errors import stream_error_frames
from mlx_server.server.http import parse_body, respond, sse_response
from mlx_server.service import ChatService, Generation
from mlx_server.text_completion import (
    CompletionOptions,
    CompletionService,
    TextPrompt,
)


def options(body: CompletionRequest) -> CompletionOptions:
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    if "max_tokens" not in body.model_fields_set and body.n_predict is not None:
        max_tokens = body.n_predict if body.n_predict >= 0 else max_tokens
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return CompletionOptions(
        max_tokens=max_tokens,
        sampling=sampling_params(body),
        stop=stop,
        top_logprobs=body.logprobs,
    )


def make_router(service: ChatService) -> APIRouter:
    router = APIRouter()
    completions = CompletionService(service)

    @router.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        if body.echo and body.logprobs is not None:
            raise InvalidRequest(
                "echo with logprobs is not supported: the prompt's log-probabilities are not "
                "computed",
                param="logprobs",
            )
        opts = options(body)
        if body.suffix is not None:  # stop where the model leaves the hole it fills
            opts = replace(opts, stop=opts.stop + fim_stop_strings(service.tokenizer))
        n = check_n(body.n, getattr(request.app.state, "max_n", DEFAULT_MAX_N))
        prompts = await completions.prepare(body.prompts(), body.suffix, opts.max_tokens)
        log(
            f"Request: completions, model={body.model}, prompts={len(prompts)}, "
            f"fim={body.suffix is not None}, stream={str(body.stream).lower()}"
        )
        request_id = f"cmpl-{uuid.uuid4().hex[:24]}"
        echoes = [p.text if body.echo else "" for p in prompts for _ in range(n)]
        enc = CompletionEncoder(
            request_id, body.model or service.model_id, echoes, body.logprobs is not None
        )
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if opts.max_tokens == 0:  # nothing to generate: the prompt (echo) and its usage
            whole = _empty(enc, prompts, n)
            return (
                sse_response(_one_chunk(whole, include_usage))
                if body.stream
                else JSONResponse(whole)
            )
        gens = start_text_choices(completions, prompts, opts, request_id, n)
        return await respond(
            request,
            stream=_stream(gens, enc, include_usage, n) if body.stream else None,
            collect=lambda: _collect(gens, enc, n),
            cancel=lambda: _cancel(gens),
        )

    return router


def _cancel(gens: list[Generation]) -> None:
    for g in gens:
        g.cancel()


def _empty(enc: CompletionEncoder, prompts: list[TextPrompt], n: int) -> dict[str, Any]:
    for i in range(len(prompts) * n):  # each prompt counted once in the usage
        enc.add(i, Finished("length", Usage(0 if i % n else len(prompts[i // n].tokens), 0)))
    return enc.response()


async def _one_chunk(whole: dict[str, Any], include_usage: bool) -> AsyncIterator[bytes]:
    """A whole response as a stream: completions chunks have the response's own shape."""
    usage = whole.pop("usage")
    yield sse(whole if include_usage else {**whole, "usage": usage})
    if include_usage:
        yield sse({**whole, "choices": [], "usage": usage})
    yield b"data: [DONE]\n\n"


async def _collect(gens: list[Generation], enc: CompletionEncoder, n: int) -> dict[str, Any]:
    async for i, ev in merged_choices(gens, n):
        if isinstance(ev, Finished) and ev.reason == "error":
            raise ServerError(ev.error or "generation failed")
        enc.add(i, ev)
    out = enc.response()
    log(f"Response: completions, {len(out['choices'])} choice(s)")
    return out


async def _stream(
    gens: list[Generation], enc: CompletionEncoder, include_usage: bool, n: int
) -> AsyncIterator[bytes]:
    for chunk in enc.echo_chunks():
        yield sse(chunk)
    left = len(gens)
    try:
        async for i, ev in merged_choices(gens, n):
            if isinstance(ev, Finished):
                if ev.reason == "error":
                    yield stream_error_frames(ev.error or "generation failed")
                    return
                left -= 1
                yield sse(enc.final_chunk(i, ev, last=left == 0, with_usage=not include_usage))
                continue
            piece = enc.chunk(i, ev)
            if piece is not None:
                yield sse(piece)
        if include_usage:
            yield sse(enc.usage_chunk())
        yield b"data: [DONE]\n\n"
    except Exception as e:  # an internal fault after the 200 went out
        traceback.print_exc()
        log(f"Error in SSE stream: {type(e).__name__}: {e}")
        yield stream_error_frames(f"internal error: {type(e).__name__}")
