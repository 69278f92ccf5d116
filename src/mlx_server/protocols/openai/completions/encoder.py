"""Neutral events → OpenAI ``text_completion`` objects (the same shape streamed and not)."""

from __future__ import annotations

import time
from typing import Any

from mlx_server.engine.core.handle import Started
from mlx_server.events import Finished, Logprobs, TextDelta, Usage
from mlx_server.logs import log
from mlx_server.protocols.openai.errors import stream_error
from mlx_server.protocols.openai.finish import (
    DONE,
    KEEPALIVE,
    finish_reason,
    timings_json,
    total_usage,
    usage_json,
)
from mlx_server.server.sse import Frame
from mlx_server.service.choices import counted_once


class LegacyLogprobs:
    """The legacy ``logprobs`` object: ``tokens``, ``token_logprobs``, ``top_logprobs`` (the
    ``k`` most likely tokens and the sampled one, token → logprob) and ``text_offset`` (where
    each token starts in the choice's ``text``)."""

    def __init__(self, offset: int):
        self.offset = offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.top_logprobs: list[dict[str, float]] = []
        self.text_offset: list[int] = []

    def add(self, ev: Logprobs, keep: bool) -> dict[str, Any]:
        """The logprobs object for just these entries (a stream chunk's); ``keep``: record
        them too (a collected answer's)."""
        part = LegacyLogprobs(self.offset)
        for e in ev.entries:
            top = {t.token: t.logprob for t in e.top}
            top.setdefault(e.token, e.logprob)
            for lp in (self, part) if keep else (part,):
                lp.tokens.append(e.token)
                lp.token_logprobs.append(e.logprob)
                lp.top_logprobs.append(top)
                lp.text_offset.append(self.offset)
            self.offset += len(e.token)
        return part.json()

    def json(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


class CompletionEncoder:
    """Builds ``text_completion`` objects for one request of one or more prompts."""

    def __init__(self, request_id: str, model: str, echoes: list[str], want_logprobs: bool):
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.echoes = echoes
        self.logprobs = (
            [LegacyLogprobs(len(e)) for e in echoes] if want_logprobs else [None] * len(echoes)
        )
        self.texts = [list([e]) if e else [] for e in echoes]
        self.finals: dict[int, Finished] = {}
        self._pending: dict[int, dict[str, Any]] = {}  # a stream's logprobs awaiting text

    def object(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        out = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        out.update(extra)
        return out

    # ---- whole responses -----------------------------------------------------------------

    def response(self) -> dict[str, Any]:
        choices = [
            {
                "text": "".join(self.texts[i]),
                "index": i,
                "logprobs": lp.json() if lp is not None else None,
                "finish_reason": finish_reason(self.finals[i]),
            }
            for i, lp in enumerate(self.logprobs)
        ]
        return self.object(choices, **self._usage_fields())

    def _usage_fields(self) -> dict[str, Any]:
        finals = [self.finals[i] for i in sorted(self.finals)]
        out: dict[str, Any] = {"usage": usage_json(total_usage(finals))}
        if len(finals) == 1 and finals[0].timings is not None:
            out["timings"] = timings_json(finals[0].timings)
        return out

    # ---- stream chunks -------------------------------------------------------------------

    def echo_chunks(self) -> list[dict[str, Any]]:
        return [self._chunk(i, e) for i, e in enumerate(self.echoes) if e]

    def _chunk(
        self, i: int, text: str, finish: str | None = None, logprobs: Any = None
    ) -> dict[str, Any]:
        choice = {"text": text, "index": i, "logprobs": logprobs, "finish_reason": finish}
        return self.object([choice])

    def add(self, i: int, ev: Any) -> None:
        """Keep one event of choice ``i`` for the whole response (``response()``)."""
        lp = self.logprobs[i]
        if isinstance(ev, Logprobs) and lp is not None:
            lp.add(ev, keep=True)
        elif isinstance(ev, TextDelta) and ev.text:
            self.texts[i].append(ev.text)

    def chunk(self, i: int, ev: Any) -> dict[str, Any] | None:
        """The chunk for one event, or None (logprobs wait for their text)."""
        lp = self.logprobs[i]
        if isinstance(ev, Logprobs) and lp is not None:
            new = lp.add(ev, keep=False)
            held = self._pending.get(i)
            if held is not None:
                for k in held:
                    held[k].extend(new[k])
            else:
                self._pending[i] = new
            return None
        if isinstance(ev, TextDelta) and ev.text:
            return self._chunk(i, ev.text, logprobs=self._pending.pop(i, None))
        return None

    def final_chunk(self, i: int, fin: Finished, last: bool, with_usage: bool) -> dict[str, Any]:
        """A choice's last chunk; the request's last one also carries the usage (unless the
        spec's own usage chunk follows) and, for a single prompt, the timings."""
        self.finals[i] = fin
        chunk = self._chunk(i, "", finish_reason(fin), self._pending.pop(i, None))
        if last:
            chunk.update(self._usage_fields())
            if not with_usage:
                del chunk["usage"]
        return chunk

    def usage_chunk(self) -> dict[str, Any]:
        finals = [self.finals[i] for i in sorted(self.finals)]
        return self.object([], usage=usage_json(total_usage(finals)))


class CompletionFrames:
    """The ``Encoder`` of one completions request: its prompts' chunks as they come (each
    choice ends with its own ``finish_reason`` chunk), or the whole ``text_completion``."""

    keepalive = KEEPALIVE

    def __init__(self, enc: CompletionEncoder, include_usage: bool):
        self.enc = enc
        self.include_usage = include_usage
        self.left = len(enc.echoes)
        self.collect = False

    def open(self, collect: bool) -> list[Frame]:
        self.collect = collect
        return [Frame(c) for c in self.enc.echo_chunks()]

    def start(self, index: int, started: Started) -> list[Frame]:
        return []

    def event(self, index: int, ev: Any) -> list[Frame]:
        if self.collect:
            self.enc.add(index, ev)
            return []
        chunk = self.enc.chunk(index, ev)
        return [Frame(chunk)] if chunk is not None else []

    def finish(self, index: int, fin: Finished) -> list[Frame]:
        self.left -= 1
        last = self.left == 0
        return [Frame(self.enc.final_chunk(index, fin, last, with_usage=not self.include_usage))]

    def end(self) -> list[Frame]:
        return ([Frame(self.enc.usage_chunk())] if self.include_usage else []) + [DONE]

    def fail(self, message: str, fin: Finished | None) -> list[Frame]:
        return [Frame(stream_error(message))]

    def result(self) -> dict[str, Any]:
        out = self.enc.response()
        log(f"Response: completions, {len(out['choices'])} choice(s)")
        return out


class PromptOnly(CompletionFrames):
    """Nothing to generate (``max_tokens: 0``): each prompt finishes at once, echoed with its
    usage, streamed as one chunk of the response's own shape."""

    def __init__(self, enc: CompletionEncoder, include_usage: bool, prompt_tokens: list[int]):
        super().__init__(enc, include_usage)
        for i, n in enumerate(prompt_tokens):
            enc.finals[i] = Finished("length", Usage(n, 0))

    def open(self, collect: bool) -> list[Frame]:
        whole = self.enc.response()
        usage = whole.pop("usage")
        if not self.include_usage:
            return [Frame({**whole, "usage": usage})]
        return [Frame(whole), Frame({**whole, "choices": [], "usage": usage})]

    def end(self) -> list[Frame]:
        return [DONE]


class TextChoiceFrames(CompletionFrames):
    """Text completions frames for ``n`` choices per prompt: each prompt's usage counted once."""

    def __init__(self, enc: CompletionEncoder, include_usage: bool, n: int):
        super().__init__(enc, include_usage)
        self.n = n

    def finish(self, index: int, fin: Finished) -> list[Frame]:
        return super().finish(index, counted_once(fin, index, self.n))
