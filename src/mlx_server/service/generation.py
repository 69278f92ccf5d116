"""One running generation, and the one path by which every service submits to the engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from mlx_server.engine.core.handle import EngineEvent, GenerationHandle, Started, TokenPiece
from mlx_server.engine.core.protocol import EngineLike
from mlx_server.errors import InvalidRequest
from mlx_server.events import Finished, Logprobs, OutputEvent
from mlx_server.logs import log
from mlx_server.parsing.pipeline import OutputPipeline
from mlx_server.request_checks import check_logit_bias
from mlx_server.types import GenerationRequest, SamplingParams

StreamEvent = OutputEvent | Logprobs | Finished


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
    """One running generation: ``started()`` once the engine takes it up, then ``events()``
    for neutral events, ending with Finished."""

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
        self._start: Started | None = None
        self._early: list[EngineEvent] = []  # read while waiting for the start, not yet used

    async def started(self) -> Started | None:
        """Wait until the engine takes the request up (it may queue first) and return its
        announcement (the prompt tokens the prefix cache covered); None if it ended
        without starting."""
        while self._start is None and not self._early:
            try:
                ev = await self.handle.next_event()
            except BaseException:  # the consumer went away while the request waited
                self.handle.cancel()
                raise
            if isinstance(ev, Started):
                self._start = ev
            else:
                self._early.append(ev)
        return self._start

    async def _engine_events(self) -> AsyncIterator[EngineEvent]:
        while self._early:
            yield self._early.pop(0)
        if not self.handle.done:
            async for ev in self.handle:
                yield ev

    def cancel(self) -> None:
        self.handle.cancel()

    async def events(self) -> AsyncIterator[StreamEvent]:
        try:
            async for ev in self._engine_events():
                if isinstance(ev, Started):  # read by started(), for the encoder's start
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
