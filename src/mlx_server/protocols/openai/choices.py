"""Chat completions with several choices (``n``): the one-choice encoders, one per choice,
their chunks tagged with the choice's ``index``, and the usage summed over the choices."""

from __future__ import annotations

import time
import traceback
from collections.abc import AsyncIterator
from typing import Any

from mlx_server.choices import merged_choices
from mlx_server.errors import ServerError
from mlx_server.events import Finished
from mlx_server.logs import log
from mlx_server.protocols.openai.completions_encoder import total_usage
from mlx_server.protocols.openai.encoder import (
    ChunkEncoder,
    MessageBuilder,
    completion_json,
    sse,
    usage_json,
)
from mlx_server.protocols.openai.errors import stream_error_frames
from mlx_server.service import Generation


def cancel_all(gens: list[Generation]) -> None:
    for g in gens:
        g.cancel()


def _indexed(chunk: dict[str, Any], i: int) -> dict[str, Any]:
    for choice in chunk["choices"]:
        choice["index"] = i
    return chunk


async def collect_choices(
    gens: list[Generation], model: str, want_logprobs: bool
) -> dict[str, Any]:
    n = len(gens)
    builders = [MessageBuilder() for _ in gens]
    finals: dict[int, Finished] = {}
    async for i, ev in merged_choices(gens, n):
        if isinstance(ev, Finished):
            if ev.reason == "error":
                raise ServerError(ev.error or "generation failed")
            finals[i] = ev
        else:
            builders[i].add(ev)
    created = int(time.time())
    rid = gens[0].request_id
    out = completion_json(rid, model, created, builders[0], finals[0], want_logprobs)
    out["choices"] = [
        _indexed(completion_json(rid, model, created, builders[i], finals[i], want_logprobs), i)[
            "choices"
        ][0]
        for i in range(n)
    ]
    out["usage"] = usage_json(total_usage([finals[i] for i in range(n)]))
    out["timings"] = None  # per sequence; several ran
    log(f"Response: {n} choices, finish={[c['finish_reason'] for c in out['choices']]}")
    return out


async def stream_choices(
    gens: list[Generation], model: str, include_usage: bool
) -> AsyncIterator[bytes]:
    encs = [ChunkEncoder(gens[0].request_id, model) for _ in gens]
    for enc in encs:
        enc.created = encs[0].created
    for i, enc in enumerate(encs):
        yield sse(_indexed(enc.role(), i))
    finals: dict[int, Finished] = {}
    try:
        async for i, ev in merged_choices(gens, len(gens)):
            if isinstance(ev, Finished):
                if ev.reason == "error":
                    yield stream_error_frames(ev.error or "generation failed")
                    return
                finals[i] = ev
                last = len(finals) == len(gens)
                chunk = _indexed(encs[i].final(ev, with_usage=False), i)
                if last and not include_usage:  # the summed usage rides on the last one
                    chunk["usage"] = usage_json(total_usage(list(finals.values())))
                yield sse(chunk)
                continue
            piece = encs[i].event(ev)
            if piece is not None:
                yield sse(_indexed(piece, i))
        if include_usage:
            usage = encs[0].usage_chunk(next(iter(finals.values())))
            usage["usage"] = usage_json(total_usage(list(finals.values())))
            yield sse(usage)
        yield b"data: [DONE]\n\n"
    except Exception as e:  # an internal fault after the 200 went out
        traceback.print_exc()
        log(f"Error in SSE stream: {type(e).__name__}: {e}")
        yield stream_error_frames(f"internal error: {type(e).__name__}")
