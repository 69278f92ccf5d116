"""Chat completions with several choices (``n``): one single-choice ``ChatEncoder`` per
choice, its chunks tagged with the choice's ``index``, the usage summed over the choices."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlx_server.choices import counted_once
from mlx_server.engine.core.handle import Started
from mlx_server.events import Finished
from mlx_server.logs import log
from mlx_server.protocols.openai.completions_encoder import (
    CompletionEncoder,
    CompletionFrames,
    total_usage,
)
from mlx_server.protocols.openai.encoder import DONE, KEEPALIVE, ChatEncoder, usage_json
from mlx_server.server.sse import Frame


class ChoicesEncoder:
    """The ``Encoder`` of a chat completion with ``n`` choices."""

    keepalive = KEEPALIVE

    def __init__(
        self, request_id: str, model: str, include_usage: bool, want_logprobs: bool, n: int
    ):
        self.encs = [ChatEncoder(request_id, model, False, want_logprobs, i) for i in range(n)]
        for e in self.encs:
            e.chunks.created = self.encs[0].chunks.created
        self.include_usage = include_usage
        self.finals: dict[int, Finished] = {}

    def _usage(self) -> dict[str, Any]:
        return usage_json(total_usage([self.finals[i] for i in sorted(self.finals)]))

    def start(self, started: Sequence[Started | None], collect: bool) -> list[Frame]:
        return [f for e, s in zip(self.encs, started, strict=True) for f in e.start([s], collect)]

    def event(self, index: int, ev: Any) -> list[Frame]:
        return self.encs[index].event(index, ev)

    def finish(self, index: int, fin: Finished) -> list[Frame]:
        fin = counted_once(fin, index, len(self.encs))
        self.finals[index] = fin
        enc = self.encs[index]
        enc.fin = fin
        chunk = enc.chunks.final(fin, with_usage=False)
        out = [Frame(chunk)]
        if len(self.finals) == len(self.encs):  # the summed usage rides on the last one
            if self.include_usage:
                usage = enc.chunks.usage_chunk(fin)
                usage["usage"] = self._usage()
                out.append(Frame(usage))
            else:
                chunk["usage"] = self._usage()
        return out

    def end(self) -> list[Frame]:
        return [DONE]

    def fail(self, message: str, fin: Finished | None) -> list[Frame]:
        return self.encs[0].fail(message, fin)

    def result(self) -> dict[str, Any]:
        out = self.encs[0].result()
        out["choices"] = [e.result()["choices"][0] for e in self.encs]
        out["usage"] = self._usage()
        out["timings"] = None  # per sequence; several ran
        log(f"Response: {len(self.encs)} choices")
        return out


class TextChoiceFrames(CompletionFrames):
    """Text completions frames for ``n`` choices per prompt: each prompt's usage counted once."""

    def __init__(self, enc: CompletionEncoder, include_usage: bool, n: int):
        super().__init__(enc, include_usage)
        self.n = n

    def finish(self, index: int, fin: Finished) -> list[Frame]:
        return super().finish(index, counted_once(fin, index, self.n))
