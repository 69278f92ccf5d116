"""A lone sequence that speculates: the lone-request runner, drafting and verifying.

Prefill runs in chunks, as the lone runner's (``chunked_prefill.ChunkedPrefill``). Each
decode step asks the drafter for up to ``k`` tokens (``controller.DraftLength`` picks
``k``), verifies them in one forward pass (``verify.verify``) and answers with every token
it emitted, one response each, like ``SoloSequence.next``. Unlike the lone runner it does not queue the next step before the
token is read: what to feed next depends on the acceptance. Between steps the KV cache
holds exactly ``fed``, and ``_todo`` the one emitted token not yet fed, so a handover to
the batch (``handover``) works as for the lone runner.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import trim_prompt_cache

from mlx_server.engine.chunked_prefill import ChunkedPrefill
from mlx_server.engine.runner import Progress, Response
from mlx_server.engine.speculative.controller import DraftLength
from mlx_server.engine.speculative.drafters import Drafter
from mlx_server.engine.speculative.verify import Processor, Verified, verify


class SpeculativeSequence(ChunkedPrefill):
    """A lone sequence's prefill and speculative decode; see the module docstring."""

    def __init__(
        self,
        model: Any,
        uid: int,
        prompt: list[int],
        cached: int,
        cache: Any,
        *,
        sampler: Callable[[mx.array], mx.array],
        greedy: bool,
        drafter: Drafter,
        num_draft_tokens: int,
        max_tokens: int,
        eos: list[int],
        prefill_step_size: int,
        processors: Sequence[Processor] = (),
        system_end: int = 0,
        adaptive: bool = True,
    ):
        # _todo: the prompt's rest, then the last emitted token
        super().__init__(
            model,
            uid,
            prompt,
            cached,
            cache,
            prefill_step_size=prefill_step_size,
            system_end=system_end,
        )
        self.sampler = sampler
        self.processors = list(processors)
        self._max_tokens = max_tokens
        self._eos = set(eos)
        self.emitted = 0
        self.drafter = drafter
        self._greedy = greedy
        self.length = DraftLength(num_draft_tokens)
        self._adaptive = adaptive
        self._num_draft = num_draft_tokens
        self.draft_n = 0  # tokens drafted
        self.draft_accepted = 0  # of those, accepted

    def next(self) -> tuple[list[Progress], list[Response]]:
        with mx.stream(generation_stream):
            if len(self._todo) > 1:
                return [self._prefill_chunk()], []
            return [], self._decode()

    def take_pending(self) -> Response | None:
        return None  # nothing is queued ahead: the emitted tokens were all answered

    def handover(self) -> tuple[list[int], Any, list[int], int]:
        """(tokens still to feed, cache, tokens in the cache, tokens left to generate)."""
        return self._todo, self.cache, self.fed, self._max_tokens - self.emitted

    def _decode(self) -> list[Response]:
        t = time.perf_counter()
        last = self._todo[0]
        left = self._max_tokens - self.emitted
        k = min(self.length.next_k() if self._adaptive else self._num_draft, left - 1)
        draft = self.drafter.propose([*self.fed, last], k) if k > 0 else []
        out = verify(
            self.model,
            self.cache,
            last,
            draft,
            sampler=None if self._greedy else self.sampler,
            processors=self.processors,
            history=self.fed,
        )
        self.length.record(len(draft), out.accepted, time.perf_counter() - t)
        self.draft_n += len(draft)
        self.draft_accepted += out.accepted
        responses = self._answer(last, out)
        responses[0].drafted, responses[0].draft_accepted = len(draft), out.accepted
        return responses

    def _answer(self, last: int, out: Verified) -> list[Response]:
        """One response per emitted token, up to the first that ends the sequence; the cache
        and ``fed`` then hold the context up to (not including) the last one answered."""
        self.fed.append(last)
        self._todo = []
        responses: list[Response] = []
        for i, tok in enumerate(out.tokens):
            self.emitted += 1
            reason = "stop" if tok in self._eos else None
            if reason is None and self.emitted >= self._max_tokens:
                reason = "length"
            if reason is None and i < len(out.tokens) - 1:
                self.fed.append(tok)
                responses.append(Response(self.uid, tok, out.logprobs[i], None))
                continue
            extra = len(out.tokens) - 1 - i  # accepted tokens in the cache after this one
            if extra:
                trim_prompt_cache(self.cache, extra)
            self._todo = [tok]
            if reason is None:
                responses.append(Response(self.uid, tok, out.logprobs[i], None))
            else:
                responses.append(
                    Response(self.uid, tok, out.logprobs[i], reason, self.cache, list(self.fed))
                )
            break
        return responses
