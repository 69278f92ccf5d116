"""One running generation, and the one path by which every service submits to the engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from mlx_server.engine.core.handle import GenerationHandle, Started, TokenPiece
from mlx_server.engine.core.protocol import EngineLike
from mlx_server.errors import InvalidRequest
from mlx_server.events import Finished, Logprobs, OutputEvent
from mlx_server.logs import log
from mlx_server.parsing.pipeline import OutputPipeline
from mlx_server.request_checks import check_logit_bias
from mlx_server.types import GenerationRequest, SamplingParams

StreamEvent = Started | OutputEvent | Logprobs | Finished


def check_sampling(sampling: SamplingParams, vocab_size: int) -> None:
    """Parameters that are valid in the protocols but not for this model."""
    top_k = sampling.top_k
    if top_k and vocab_size and top_k >= vocab_size:
        raise InvalidRequest(
            f"top_k must be below the model's vocabulary size ({vocab_size}); got {top_k}",
            param="top_k",
        )
    check_logit_bias(sampling, vocab_size)


def submit(engine: EngineLike, req: GenerationRequest, pipeline: OutputPipeline) -> Generation:
    """Queue a built request on the engine, its output read through ``pipeline``."""
    handle = engine.submit(req, asyncio.get_running_loop())
    return Generation(req.request_id, handle, pipeline, len(req.prompt_tokens))


class Generation:
    """One running generation: iterate ``events()`` for ``Started`` once the engine takes
    it up, then neutral events, ending with Finished."""

    def __init__(
        self,
        request_id: str,
        handle: GenerationHandle,
        pipeline: OutputPipeline,
        prompt_tokens: int,
    ):
        self.request_id = request_id
        self.handle = handle
        self.pipeline = pipeline
        self.prompt_tokens = prompt_tokens

    def cancel(self) -> None:
        self.handle.cancel()

    async def events(self) -> AsyncIterator[StreamEvent]:
        try:
            async for ev in self.handle:
                if isinstance(ev, Started):  # for the encoder's opening frames
                    yield ev
                    continue
                if isinstance(ev, TokenPiece):
                    if ev.logprobs:
                        yield Logprobs(ev.logprobs)
                    for out in self.pipeline.feed(ev.text):
                        yield out
                    continue
                for out in self.pipeline.flush():
                    yield out
                yield self._final(ev)
        finally:
            if not self.handle.done:
                self.handle.cancel()  # the consumer went away: free the slot

    def _final(self, ev: Finished) -> Finished:
        reason = ev.reason
        in_reasoning = self.pipeline.in_reasoning
        if reason == "stop" and self.pipeline.saw_tool_calls:
            reason = "tool_calls"
        elif reason in ("stop", "stop_sequence") and in_reasoning:
            log("Generation ended inside the reasoning block: no answer was produced")
        if ev.error:
            log(f"Error during generation: {ev.error}")
        return replace(ev, reason=reason, in_reasoning=in_reasoning)
