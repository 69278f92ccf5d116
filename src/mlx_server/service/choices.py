"""Several choices for one request (OpenAI's ``n``), as a thin fan-out over generations.

Each choice is its own engine request with the same prompt, submitted together, so the
choices decode side by side in the continuous batch (and the queue's admission counts every
one of them: if the queue cannot take them all, none runs). They share the request id, so
``/v1/cancel`` with it stops them all. Choice ``i`` samples with ``seed + i`` (modulo
2**64): a seeded request is reproducible choice by choice, and ``n: 1`` samples exactly as
before. Each choice has its own output parsers and, under ``response_format`` or an
enforced tool choice, its own grammar state. The usage counts each prompt once (as OpenAI
and vLLM do) and every choice's completion tokens.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace

from mlx_server.errors import InvalidRequest
from mlx_server.events import Finished, Usage
from mlx_server.service.chat import ChatService
from mlx_server.service.generation import Generation
from mlx_server.service.prompt import PreparedPrompt
from mlx_server.service.text_completion import CompletionOptions, CompletionService, TextPrompt
from mlx_server.types import ChatRequest, GenerationRequest, SamplingParams

_SEEDS = 1 << 64


def check_n(n: int | None, max_n: int) -> int:
    """The number of choices asked for; more than ``max_n`` is a 400."""
    n = 1 if n is None else n
    if n > max_n:
        raise InvalidRequest(
            f"n must be at most {max_n} on this server (--max-n); got {n}", param="n"
        )
    return n


def choice_sampling(sampling: SamplingParams, i: int) -> SamplingParams:
    """Choice ``i``'s sampling settings: its own seed stream when the request is seeded."""
    if sampling.seed is None or i == 0:
        return sampling
    seed = sampling.seed + i
    return replace(sampling, seed=seed - _SEEDS if seed >= _SEEDS else seed)


def _build_chat(
    service: ChatService, chat: ChatRequest, n: int, request_id: str
) -> list[tuple[ChatRequest, GenerationRequest, PreparedPrompt]]:
    first, prepared = service.build_request(chat, request_id)
    out = [(chat, first, prepared)]
    for i in range(1, n):
        chat_i = replace(chat, sampling=choice_sampling(chat.sampling, i))
        if first.logits_processors:  # a grammar keeps per-sequence state: build each its own
            req, prepared_i = service.build_request(chat_i, request_id)
            out.append((chat_i, req, prepared_i))
        else:  # the same prompt and hints, rendered once
            out.append((chat_i, replace(first, sampling=chat_i.sampling), prepared))
    return out


async def start_chat_choices(
    service: ChatService, chat: ChatRequest, n: int, request_id: str | None = None
) -> list[Generation]:
    """Render once (in a worker thread), submit ``n`` generations; if the engine refuses
    one (queue full), cancel the others and raise."""
    request_id = request_id or f"chatcmpl-{uuid.uuid4().hex[:24]}"
    built = await asyncio.to_thread(_build_chat, service, chat, n, request_id)
    gens: list[Generation] = []
    try:
        for chat_i, req, prepared in built:
            gens.append(service.submit(chat_i, req, prepared))
    except BaseException:
        for g in gens:
            g.cancel()
        raise
    return gens


def start_text_choices(
    completions: CompletionService,
    prompts: list[TextPrompt],
    opts: CompletionOptions,
    request_id: str,
    n: int,
) -> list[Generation]:
    """``n`` generations per prompt, in OpenAI's order: prompt ``p``'s choice ``j`` is
    choice ``p * n + j``. All or none are submitted."""
    rounds: list[list[Generation]] = []
    try:
        for j in range(n):
            opts_j = replace(opts, sampling=choice_sampling(opts.sampling, j))
            rounds.append(completions.start(prompts, opts_j, request_id))
    except BaseException:
        for gens in rounds:
            for g in gens:
                g.cancel()
        raise
    return [rounds[j][p] for p in range(len(prompts)) for j in range(n)]


def counted_once(fin: Finished, index: int, n: int) -> Finished:
    """Choice ``index``'s final event with its prompt counted once: choice ``i`` is copy
    ``i % n`` of its prompt, and the copies after the first report no prompt tokens, so
    usage summed over the choices counts each prompt once."""
    if index % n == 0:
        return fin
    return replace(fin, usage=Usage(0, fin.usage.completion_tokens, 0))
