"""Continuous batching over mlx-lm's ``BatchGenerator``, behind the runner interface.

Sequences join the running batch after their (chunked) prefill and leave it at the next
step; ``BatchGenerator`` numbers them itself, so the runner maps its numbers to the
scheduler's uids. A sequence handed over from the solo runner joins as a prefix-cache hit
would: its cache, the tokens in it, and the tokens still to feed.

The model inside mlx-lm's decode batch is wrapped (``batch_step.DecodeStep``): grammars are
masked for the whole batch at once, processors run only on the rows that have some, and
each distinct sampler draws for all its rows in one call. A sequence's first token is
sampled in the batch mlx-lm makes for sequences that have just finished their prefill: its
grammars masked for that group at once too (``batch_step.mask_first_steps``), its other
processors and samplers mlx-lm's per-row calls.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.generate import BatchGenerator, StopSequences

from mlx_server.engine.core.wired import hands_off
from mlx_server.engine.grammar.masks import GrammarMasks
from mlx_server.engine.runners.base import Insert, KVState, Progress, Response
from mlx_server.engine.runners.batch_step import (
    DecodeStep,
    RowGrammar,
    mask_first_steps,
    row_grammar,
)
from mlx_server.engine.sampling.logprobs import BATCH_TOP, PickedValues
from mlx_server.engine.sampling.samplers import LogitsProcessor, Sampler


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
        by_group: bool = True,
        launch_first: bool | None = None,
    ):
        """``batch_grammars=False`` leaves grammars to mlx-lm's per-row processor calls
        (the way before the batched masks; kept to compare against); ``by_group=False``
        leaves processors and sampling to mlx-lm's step (row by row when rows differ);
        ``launch_first``: the masked step's order (``tuning.GRAMMAR_LAUNCH_FIRST`` when
        None)."""
        self._launch_first = launch_first
        self.model = model
        self._eos = eos
        self._max_batch = max_batch_size
        self._step_size = prefill_step_size
        self._keep_caches = keep_caches  # return the KV state of removed sequences
        self._batch_grammars = batch_grammars
        self._by_group = by_group
        self._masks = grammar_masks
        self._grammars: dict[int, RowGrammar] = {}  # BatchGenerator's number -> its grammar
        # BatchGenerator's number -> how many alternatives its log-probabilities list, for
        # the rows that ask (computed in the decode step's graph: ``DecodeStep``)
        self._wants: dict[int, int] = {}
        self._decode: DecodeStep | None = None
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
        if self._batch_grammars or self._by_group:
            # The decode batch lives as long as the generator (it grows and shrinks in place).
            decode = gen._generation_batch
            decode.model = self._decode = DecodeStep(
                decode.model,
                decode,
                self._grammars,
                self._grammar_masks,
                by_group=self._by_group,
                launch_first=self._launch_first,
                wants=self._wants,
            )
        if self._batch_grammars:
            mask_first_steps(gen, self._first_step)
        return gen

    def _first_step(self, model: Any, rows: Any) -> DecodeStep:
        """The model of a new group's first decode step: its grammars masked at once."""
        return DecodeStep(
            model,
            rows,
            self._grammars,
            self._grammar_masks,
            by_group=False,
            launch_first=self._launch_first,
        )

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
            job.request.top_logprobs if job.request.logprobs else -1,
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
        top_logprobs: int = -1,
    ) -> None:
        """Add a sequence: ``segments`` still to feed after the ``fed`` tokens in ``cache``;
        ``top_logprobs``: the alternatives its log-probabilities list (-1: none asked)."""
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
        grammar = row_grammar(processors) if self._batch_grammars else None
        if grammar is not None:
            self._grammars[gen_uid] = grammar
        if 0 <= top_logprobs <= BATCH_TOP and self._by_group:  # figured in the decode step
            self._wants[gen_uid] = top_logprobs

    def step(self) -> tuple[list[Progress], list[Response]]:
        progress, responses = self._gen.next()
        picks = self._read_picks()
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
            picked = picks.get(r.uid) if picks else None
            answers.append(
                Response(
                    uid,
                    r.token,
                    r.logprobs,
                    r.finish_reason,
                    r.prompt_cache,
                    r.all_tokens,
                    picked=picked,
                )
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
        self._uid.clear()
        self._gen_uid.clear()
        self._grammars.clear()
        self._wants.clear()
        self._gen = self._new_generator()

    def close(self) -> None:
        self._gen.close()
        if self._masks is not None:
            self._masks.close()

    def stats(self) -> dict[str, Any]:
        return {}

    def _read_picks(self) -> dict[int, PickedValues] | None:
        """The log-probability figures of the tokens this step read (made in the step that
        sampled them, so reading them waits for nothing): by BatchGenerator's number."""
        decode = self._decode
        if decode is None or decode.ready is None:
            return None
        ready, decode.ready = decode.ready, None
        return ready.read()

    def _forget(self, uid: int) -> None:
        gen_uid = self._gen_uid.pop(uid, None)
        if gen_uid is not None:
            self._uid.pop(gen_uid, None)
            self._grammars.pop(gen_uid, None)
            self._wants.pop(gen_uid, None)
