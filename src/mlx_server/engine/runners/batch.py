"""Continuous batching over mlx-lm's ``BatchGenerator``, behind the runner interface.

Sequences join the running batch after their (chunked) prefill and leave it at the next
step; ``BatchGenerator`` numbers them itself, so the runner maps its numbers to the
scheduler's uids. A sequence handed over from the solo runner joins as a prefix-cache hit
would: its cache, the tokens in it, and the tokens still to feed.

Grammars are masked for the whole batch at once (``grammar_masks.GrammarMasks``): the model
inside mlx-lm's decode batch is wrapped (``MaskedDecode``), and from a sequence's second
decode step on its grammar leaves mlx-lm's per-row processor list. Its first token is
sampled under the grammar by that per-row processor, in the batch mlx-lm makes for
sequences that have just finished their prefill.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences

from mlx_server.engine.core.wired import hands_off
from mlx_server.engine.grammar.masks import BatchGrammar, GrammarMasks
from mlx_server.engine.grammar.processor import GrammarLogitsProcessor
from mlx_server.engine.runners.base import Insert, KVState, Progress, Response
from mlx_server.engine.sampling.samplers import GuardedProcessor, LogitsProcessor, Sampler


class BatchRunner:
    """mlx-lm's continuous batching; see the module docstring."""

    def __init__(
        self,
        model: Any,
        eos: list[int],
        *,
        max_batch_size: int,
        prefill_step_size: int,
        keep_caches: bool = True,
        grammar_masks: GrammarMasks | None = None,
        batch_grammars: bool = True,
    ):
        """``batch_grammars=False`` leaves grammars to mlx-lm's per-row processor calls
        (the way before the batched masks; kept to compare against)."""
        self.model = model
        self._eos = eos
        self._max_batch = max_batch_size
        self._step_size = prefill_step_size
        self._keep_caches = keep_caches  # return the KV state of removed sequences
        self._batch_grammars = batch_grammars
        self._masks = grammar_masks
        self._grammars: dict[int, _RowGrammar] = {}  # BatchGenerator's number -> its grammar
        self._gen = self._new_generator()
        self._uid: dict[int, int] = {}  # BatchGenerator's number -> the scheduler's uid
        self._gen_uid: dict[int, int] = {}  # and back

    def __len__(self) -> int:
        return len(self._uid)

    def _new_generator(self) -> BatchGenerator:
        gen = BatchGenerator(
            self.model,
            completion_batch_size=self._max_batch,
            # Prompts that arrive together prefill together; the scheduler bounds the
            # tokens one step prefills.
            prefill_batch_size=self._max_batch,
            prefill_step_size=self._step_size,
            stop_tokens=[[t] for t in self._eos],
        )
        hands_off(gen)  # the process's wired limit is set once (wired.py)
        if self._batch_grammars:
            # The decode batch lives as long as the generator (it grows and shrinks in place).
            decode = gen._generation_batch
            decode.model = MaskedDecode(decode.model, decode, self._grammars, self._grammar_masks)
        return gen

    def _grammar_masks(self) -> GrammarMasks:
        if self._masks is None:  # its thread pool, only once a grammar runs
            self._masks = GrammarMasks()
        return self._masks

    def insert(self, job: Insert) -> None:
        self.join(
            job.uid,
            job.segments,
            job.cache,
            job.prompt[: job.cached],
            job.request.max_tokens,
            job.sampler,
            job.processors,
        )

    def join(
        self,
        uid: int,
        segments: list[list[int]],
        cache: Any,
        fed: list[int],
        max_tokens: int,
        sampler: Sampler,
        processors: list[LogitsProcessor],
    ) -> None:
        """Add a sequence: ``segments`` still to feed after the ``fed`` tokens in ``cache``."""
        (gen_uid,) = self._gen.insert_segments(
            segments=[segments],
            max_tokens=[max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[fed],
            samplers=[sampler],
            logits_processors=[processors],
            stop_sequences=[StopSequences([[t] for t in self._eos])],
        )
        self._uid[gen_uid] = uid
        self._gen_uid[uid] = gen_uid
        grammar = _row_grammar(processors) if self._batch_grammars else None
        if grammar is not None:
            self._grammars[gen_uid] = grammar

    def step(self) -> tuple[list[Progress], list[Response]]:
        progress, responses = self._gen.next()
        ours = self._uid
        out = [
            Progress(ours[p.uid], p.progress, p.end_of_segment, p.end_of_prompt)
            for p in progress
            if p.uid in ours
        ]
        answers = []
        for r in responses:
            uid = ours.get(r.uid)
            if uid is None:
                continue
            answers.append(
                Response(uid, r.token, r.logprobs, r.finish_reason, r.prompt_cache, r.all_tokens)
            )
            if r.finish_reason is not None:  # BatchGenerator has let it go
                self._forget(uid)
        return out, answers

    def remove(self, uids: list[int]) -> dict[int, KVState]:
        mine = {self._gen_uid[u]: u for u in uids if u in self._gen_uid}
        if not mine:
            return {}
        saved = self._gen.remove(list(mine), return_prompt_caches=self._keep_caches)
        for u in mine.values():
            self._forget(u)
        return {mine[g]: state for g, state in (saved or {}).items() if g in mine}

    def extract_state(self, uids: list[int]) -> dict[int, KVState]:
        mine = {self._gen_uid[u]: u for u in uids if u in self._gen_uid}
        if not mine:
            return {}
        return {mine[g]: state for g, state in self._gen.extract_cache(list(mine)).items()}

    def reset(self) -> None:
        self._gen.close()
        self._gen = self._new_generator()
        self._uid.clear()
        self._gen_uid.clear()
        self._grammars.clear()

    def close(self) -> None:
        self._gen.close()
        if self._masks is not None:
            self._masks.close()

    def stats(self) -> dict[str, Any]:
        return {}

    def _forget(self, uid: int) -> None:
        gen_uid = self._gen_uid.pop(uid, None)
        if gen_uid is not None:
            self._uid.pop(gen_uid, None)
            self._grammars.pop(gen_uid, None)


@dataclass(eq=False)
class _RowGrammar:
    """A sequence's grammar: the processor object in its per-row list, and the batch's view."""

    listed: Any  # what mlx-lm's per-row list holds (the guard around the grammar, or it)
    grammar: BatchGrammar
    adopted: bool = False  # taken out of the per-row list, masked by the batch


def _row_grammar(processors: list[LogitsProcessor]) -> _RowGrammar | None:
    for p in processors:
        if isinstance(p, GuardedProcessor) and isinstance(p.processor, GrammarLogitsProcessor):
            return _RowGrammar(p, BatchGrammar(p.processor, p.owner))
        if isinstance(p, GrammarLogitsProcessor):
            return _RowGrammar(p, BatchGrammar(p))
    return None


class MaskedDecode:
    """Stands in for the model inside mlx-lm's decode batch (``GenerationBatch``, whose
    step calls ``self.model(inputs[:, None], cache=...)`` and reads the last position):
    runs the model, then masks the rows of sequences with a grammar, the whole batch in one
    ``GrammarMasks`` call, while the device computes the forward pass. mlx-lm's per-row
    processors (penalties, bias, ``ignore_eos``) then see the masked logits; a mask sets
    scores to -inf, which those leave at -inf, so the order changes no result.
    """

    def __init__(
        self,
        model: Any,
        batch: Any,
        grammars: dict[int, _RowGrammar],
        masks: Callable[[], GrammarMasks],
    ):
        self.model = model
        self._batch = batch
        self._grammars = grammars
        self._masks = masks

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        rows = self._rows() if self._grammars else None
        if rows is None:
            return cast(mx.array, self.model(inputs, cache=cache))
        # The fed tokens are scheduled apart, so reading them waits for the previous step
        # only (a read of anything queued after the forward pass would wait for all of
        # it). The grammars consume them and fill their masks on the masks' worker thread
        # while this one launches the pass (with one core to spare, here after the launch,
        # while the device runs it); the masks are applied before sampling.
        mx.async_eval(inputs)
        logits = self.model(inputs, cache=cache)[:, -1, :]
        tokens = [row[-1] for row in cast(list[list[int]], inputs.tolist())]
        masks = self._masks()
        plan = masks.plan(rows, tokens)
        if plan is None:
            return logits[:, None, :]
        vocab = logits.shape[-1]
        pending = masks.submit(plan, vocab) if masks.overlap else None
        mx.async_eval(logits)
        plan = pending.result() if pending is not None else masks.compute(plan, vocab)
        return masks.mask(plan, logits)[:, None, :]

    def __getattr__(self, name: str) -> Any:
        if name == "model":  # not set yet
            raise AttributeError(name)
        return getattr(self.model, name)

    def _rows(self) -> list[BatchGrammar | None] | None:
        """Each row's grammar (None: none); None when no row has one. A grammar seen here
        for the first time leaves its row's per-row processor list."""
        batch = self._batch
        found = [self._grammars.get(uid) for uid in batch.uids]
        if not any(found):
            return None
        for e, row in enumerate(found):
            if row is not None and not row.adopted:
                listed = batch.logits_processors[e] or ()
                batch.logits_processors[e] = tuple(p for p in listed if p is not row.listed)
                row.adopted = True
        return [row.grammar if row is not None else None for row in found]
