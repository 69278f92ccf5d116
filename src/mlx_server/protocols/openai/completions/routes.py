"""OpenAI legacy Completions: ``POST /v1/completions`` (raw prompts, fill-in-the-middle)."""

from __future__ import annotations

import uuid
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import Response

from mlx_server.errors import InvalidRequest
from mlx_server.logs import log
from mlx_server.models.text_prompt import fim_stop_strings
from mlx_server.protocols.openai.completions.encoder import (
    CompletionEncoder,
    PromptOnly,
    TextChoiceFrames,
)
from mlx_server.protocols.openai.completions.schemas import CompletionRequest
from mlx_server.protocols.openai.sampling import sampling_params
from mlx_server.registry.lease import Models
from mlx_server.server.http import parse_and_lease
from mlx_server.server.streaming import respond
from mlx_server.service.choices import check_n, start_text_choices
from mlx_server.service.text_completion import CompletionOptions, CompletionService


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
        ignore_eos=bool(body.ignore_eos),
    )


def make_router(models: Models, *, max_n: int, keepalive_s: float, max_queue: int) -> APIRouter:
    """``max_queue``: the requests the engine lets wait (--max-queue); a batch of prompts
    asking for more generations than that could never be queued whole, so it is a 400, not
    a 503 to retry."""
    router = APIRouter()

    @router.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        body, service = await parse_and_lease(request, CompletionRequest, models.chat)
        completions = CompletionService(service)
        if body.echo and body.logprobs is not None:
            raise InvalidRequest(
                "echo with logprobs is not supported: the prompt's log-probabilities are not "
                "computed",
                param="logprobs",
            )
        opts = options(body)
        if body.suffix is not None:  # stop where the model leaves the hole it fills
            opts = replace(opts, stop=opts.stop + fim_stop_strings(service.tokenizer))
        n = check_n(body.n, max_n)
        asked = len(body.prompts()) * n
        if asked > max_queue:
            raise InvalidRequest(
                f"the request asks for {asked} generations (prompts x n); this server takes at "
                f"most {max_queue} at once (--max-queue): send fewer prompts or a smaller n",
                param="prompt",
            )
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
            only = PromptOnly(
                enc, include_usage, [0 if j else len(p.tokens) for p in prompts for j in range(n)]
            )
            return await respond(request, only, [], stream=body.stream, keepalive_s=keepalive_s)
        gens = start_text_choices(completions, prompts, opts, request_id, n)
        frames = TextChoiceFrames(enc, include_usage, n)
        return await respond(request, frames, gens, stream=body.stream, keepalive_s=keepalive_s)

    return router
