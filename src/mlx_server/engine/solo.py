"""One sequence decoded alone, on a plain KV cache: mlx-lm's ``stream_generate`` path.

mlx-lm's BatchGenerator keeps every sequence in a batched cache with per-sequence offsets
and an attention mask, which a batch of one pays for too: on a GPU its step for a lone
stream costs about a third more than ``generate_step``'s, and its prefill is slower still.
So a request that arrives at an idle engine, with no logits processors, runs here; when a
second request comes, the engine hands the sequence (its cache, the tokens in it and the
next token to feed) over to the BatchGenerator, which continues it like a prefix-cache hit.

``next()`` answers like ``BatchGenerator.next()``: prefill progress, then one response per
step with the token, its log-probabilities and a finish reason. Decoding is pipelined like
``generate_step``: the step after a token is queued on the GPU before the token is read.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache


@dataclass
class Progress:
    uid: int
    progress: tuple[int, int]
    end_of_segment: bool = False
    end_of_prompt: bool = False


@dataclass
class Response:
    uid: int
    token: int
    logprobs: mx.array
    finish_reason: str | None
    prompt_cache: Any = None
    all_tokens: list[int] | None = None


class SoloSequence:
    """A lone sequence's prefill and decode; see the module docstring."""

    def __init__(
        self,
        model: Any,
        uid: int,
        prompt: list[int],
        cached: int,
        cache: Any,
        *,
        sampler: Callable[[mx.array], mx.array],
        max_tokens: int,
        eos: list[int],
        prefill_step_size: int,
        system_end: int = 0,
        on_system_prefix: Callable[[list[int], Any], None] | None = None,
    ):
        self.model = model
        self.uid = uid
        self.sampler = sampler
        self.cache = cache if cache is not None else make_prompt_cache(model)
        self.fed = list(prompt[:cached])  # the tokens in the cache
        self._todo = list(prompt[cached:])  # prompt tokens still to feed (never empty at first)
        self._total = len(self._todo)
        self._max_tokens = max_tokens
        self._eos = set(eos)
        self._step_size = prefill_step_size
        self._system_end = system_end if cached < system_end < len(prompt) - 1 else 0
        self._on_system_prefix = on_system_prefix
        self._next: tuple[mx.array, mx.array] | None = None  # sampled, not yet read
        self.emitted = 0

    def next(self) -> tuple[list[Progress], list[Response]]:
        with mx.stream(generation_stream):
            if len(self._todo) > 1:
                return [self._prefill_chunk()], []
            if self._next is None:  # the prompt's last token gives the first sample
                self._next = self._forward(mx.array(self._todo))
                self.fed += self._todo
                self._todo = []
            token, logprobs = self._next
            self._next = self._forward(token)  # queued before this token is read
            mx.async_eval(*self._next)
            return [], [self._emit(token, logprobs, fed=True)]

    def take_pending(self) -> Response | None:
        """The token sampled but not yet read (None while prefilling), as a response; the
        sequence then continues from it (``handover``)."""
        if self._next is None:
            return None
        token, logprobs = self._next
        self._next = None
        self._todo = []
        r = self._emit(token, logprobs, fed=False)
        self._todo = [r.token]
        return r

    def handover(self) -> tuple[list[int], Any, list[int], int]:
        """(tokens still to feed, cache, tokens in the cache, tokens left to generate)."""
        return self._todo, self.cache, self.fed, self._max_tokens - self.emitted

    def _prefill_chunk(self) -> Progress:
        n = min(self._step_size, len(self._todo) - 1)
        if self._system_end > len(self.fed):  # pause where the system prompt ends
            n = min(n, self._system_end - len(self.fed))
        self.model(mx.array(self._todo[:n])[None], cache=self.cache)
        mx.eval([c.state for c in self.cache])
        self.fed += self._todo[:n]
        self._todo = self._todo[n:]
        if len(self.fed) == self._system_end and self._on_system_prefix is not None:
            self._on_system_prefix(list(self.fed), copy.deepcopy(self.cache))
        mx.clear_cache()
        return Progress(self.uid, (self._total - len(self._todo), self._total))

    def _forward(self, tokens: mx.array) -> tuple[mx.array, mx.array]:
        logits = self.model(tokens[None], cache=self.cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return self.sampler(logprobs), logprobs.squeeze(0)

    def _emit(self, token: mx.array, logprobs: mx.array, fed: bool) -> Response:
        tok = int(token.item())  # type: ignore[arg-type]
        if fed:
            self.fed.append(tok)
        self.emitted += 1
        reason = None
        if tok in self._eos:
            reason = "stop"
        elif self.emitted >= self._max_tokens:
            reason = "length"
        if reason is None:
            return Response(self.uid, tok, logprobs, None)
        return Response(self.uid, tok, logprobs, reason, self.cache, list(self.fed))
