"""The batch runner's hook into mlx-lm's decode step: grammars masked, processors run and
rows sampled for the whole batch, with work per step that grows with the distinct settings
in the batch rather than with its rows.

mlx-lm's decode batch (``GenerationBatch``) calls ``self.model(inputs[:, None], cache=...)``
each step, then runs every row's logits processors (slicing every row as soon as one has
any), then samples (row by row unless every row has the same sampler object). ``DecodeStep``
stands in for that model. Per step it

- masks the rows of sequences with a grammar, the whole batch in one ``GrammarMasks`` call
  while the device computes the forward pass (a grammar leaves its row's processor list the
  first time it is seen here);
- runs the other processors of the rows that have some (``rows.process_rows``), and hands
  mlx-lm empty processor lists for the step;
- hands mlx-lm one sampler object for every row, which samples each distinct sampler's rows
  in one call (``rows.sample_by_group``) and then gives the batch its own per-row lists
  back, so that between steps (filtering, joining, speculation's verifying steps) the batch
  holds exactly what mlx-lm put there.

A mask sets scores to -inf, which penalties and biases leave at -inf, so masking first
changes no result.

A group of sequences that just finished their prefill takes its first decode step in a
``GenerationBatch`` of its own, which mlx-lm builds (``PromptProcessingBatch.generate``)
and steps at once, with the raw model and the per-row processor lists, before it joins the
decode batch. ``mask_first_steps`` puts a ``DecodeStep`` (grammars only) in that step too:
else each row's grammar ran its processor call there (a launch, a read of the row's last
token and its own mask, row after row: about 5 % of the engine thread at 32 streams of
json_schema on an H100, bench/results/gpu-2026-12-07h-pyspy-*).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch

from mlx_server.engine.core import tuning
from mlx_server.engine.grammar.masks import BatchGrammar, GrammarMasks
from mlx_server.engine.grammar.processor import GrammarLogitsProcessor
from mlx_server.engine.sampling.logprobs import BatchPicks, batch_picks
from mlx_server.engine.sampling.rows import process_rows, sample_by_group
from mlx_server.engine.sampling.samplers import GuardedProcessor, LogitsProcessor


@dataclass(eq=False)
class RowGrammar:
    """A sequence's grammar: the processor object in its per-row list, and the batch's view."""

    listed: Any  # what mlx-lm's per-row list holds (the guard around the grammar, or it)
    grammar: BatchGrammar
    adopted: bool = False  # taken out of the per-row list, masked by the batch


def row_grammar(processors: list[LogitsProcessor]) -> RowGrammar | None:
    for p in processors:
        if isinstance(p, GuardedProcessor) and isinstance(p.processor, GrammarLogitsProcessor):
            return RowGrammar(p, BatchGrammar(p.processor, p.owner))
        if isinstance(p, GrammarLogitsProcessor):
            return RowGrammar(p, BatchGrammar(p))
    return None


class DecodeStep:
    """Stands in for the model inside mlx-lm's decode batch; see the module docstring."""

    def __init__(
        self,
        model: Any,
        batch: Any,
        grammars: dict[int, RowGrammar],
        masks: Callable[[], GrammarMasks],
        *,
        by_group: bool = True,
        launch_first: bool | None = None,
        wants: dict[int, int] | None = None,
    ):
        """``by_group=False``: leave processors and sampling to mlx-lm (grammars only);
        ``launch_first``: queue a masked step's forward pass before reading the tokens its
        masks need (None: ``tuning.GRAMMAR_LAUNCH_FIRST``); ``wants``: the rows (by the
        batch's uids) whose log-probabilities are asked for, and how many alternatives
        (kept up to date by the runner)."""
        self._launch_first = tuning.GRAMMAR_LAUNCH_FIRST if launch_first is None else launch_first
        self._wants = wants if wants is not None else {}
        self._picking = False  # this step computes the asking rows' figures (``_must_lend``)
        self._made: BatchPicks | None = None  # this step's figures, for its tokens
        self.ready: BatchPicks | None = None  # the figures of the tokens this step reads
        self.model = model
        self._batch = batch
        self._grammars = grammars
        self._masks = masks
        self._by_group = by_group
        self._lent: tuple[list[Any], list[Any]] | None = None  # the batch's own lists
        self._sample = _BatchSampler(self)

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        self.give_back()  # should a step have failed between here and its sampling
        # The tokens this step feeds (and mlx-lm then reads) were sampled by the last one.
        self.ready, self._made = self._made, None
        rows = self._rows() if self._grammars else None
        lend = self._must_lend()
        if rows is None and not lend:  # mlx-lm's own step, exactly
            return cast(mx.array, self.model(inputs, cache=cache))
        if rows is None:
            logits = cast(mx.array, self.model(inputs, cache=cache))[:, -1, :]
        else:
            logits = self._masked(inputs, cache, rows)
        if lend:
            logits = self._lend(inputs, logits)
        return logits[:, None, :]

    def __getattr__(self, name: str) -> Any:
        if name == "model":  # not set yet
            raise AttributeError(name)
        return getattr(self.model, name)

    def give_back(self) -> None:
        """Give the batch back its own samplers and processor lists (after sampling)."""
        if self._lent is not None:
            self._batch.samplers, self._batch.logits_processors = self._lent
            self._lent = None

    # ---- processors and samplers for the whole batch ----------------------------------------

    def _must_lend(self) -> bool:
        """Whether mlx-lm's own step would go row by row: several sampler objects, or a
        row with processors."""
        batch = self._batch
        samplers = getattr(batch, "samplers", None)
        self._picking = False
        if not self._by_group or samplers is None:
            return False
        self._picking = self._picks_wanted()
        first = samplers[0] if samplers else None
        return (
            self._picking or any(s is not first for s in samplers) or any(batch.logits_processors)
        )

    def _picks_wanted(self) -> bool:
        """Whether a row asks for log-probabilities, in a batch that decodes only through
        this step (a speculating batch's verifying steps emit tokens of their own)."""
        wants = self._wants
        return (
            bool(wants)
            and type(self._batch) is GenerationBatch
            and any(u in wants for u in self._batch.uids)
        )

    def _pick(self, logprobs: mx.array, tokens: mx.array) -> None:
        """The asking rows' figures, in the step's graph and evaluated with it."""
        if not self._picking:
            return
        made = batch_picks(logprobs, tokens, list(self._batch.uids), self._wants)
        if made is not None:
            mx.async_eval(tokens, *made.arrays())
        self._made = made

    def _lend(self, inputs: mx.array, logits: mx.array) -> mx.array:
        """Run the rows' processors here and lend mlx-lm one sampler for every row."""
        batch = self._batch
        samplers, processors = batch.samplers, batch.logits_processors
        n = len(batch.uids)
        with_processors = [e for e in range(n) if processors[e]]
        if with_processors:
            contexts = batch._token_context
            todo = [(e, processors[e], contexts[e]) for e in with_processors]
            logits = process_rows(logits, inputs[:, 0], todo)
        fallback = batch.fallback_sampler
        self._sample.rows = [fallback if s is None else s for s in samplers] or [fallback] * n
        self._lent = (samplers, processors)
        batch.samplers = [self._sample] * n
        batch.logits_processors = [()] * n
        return logits

    # ---- grammars -----------------------------------------------------------------------

    def _masked(self, inputs: mx.array, cache: Any, rows: list[BatchGrammar | None]) -> mx.array:
        # The fed tokens are scheduled apart, so reading them waits for the previous step
        # only (a read of anything queued after the forward pass would wait for all of it).
        mx.async_eval(inputs)
        logits = cast(mx.array, self.model(inputs, cache=cache))[:, -1, :]
        if self._launch_first:
            # The pass is queued behind the previous step before its tokens are read, as
            # free decoding's is: the device never waits for the host's read and fill.
            mx.async_eval(logits)
        tokens = [row[-1] for row in cast(list[list[int]], inputs.tolist())]
        masks = self._masks()
        plan = masks.plan(rows, tokens)
        if plan is None:
            return logits
        vocab = logits.shape[-1]
        if self._launch_first:  # the fill runs here, while the device runs the pass
            return masks.mask(masks.compute(plan, vocab), logits)
        # Otherwise the grammars consume and fill on the masks' worker thread while this
        # one launches the pass (with one core to spare, here after the launch).
        pending = masks.submit(plan, vocab) if masks.overlap else None
        mx.async_eval(logits)
        plan = pending.result() if pending is not None else masks.compute(plan, vocab)
        return masks.mask(plan, logits)

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


class _BatchSampler:
    """The one sampler mlx-lm sees for every row while a step is lent (see ``DecodeStep``)."""

    def __init__(self, step: DecodeStep):
        self._step = step
        self.rows: list[Any] = []

    def __call__(self, logprobs: mx.array) -> mx.array:
        rows, self.rows = self.rows, []
        self._step.give_back()
        tokens = sample_by_group(rows, logprobs)
        self._step._pick(logprobs, tokens)
        return tokens


@dataclass
class _NewRows:
    """What a ``DecodeStep`` reads of a batch, for a group whose batch is being built: the
    lists mlx-lm hands that ``GenerationBatch`` (the same objects, so that a grammar leaving
    its row's processor list leaves the batch's)."""

    uids: list[int]
    logits_processors: list[Any]


class FirstStepPrompts(PromptProcessingBatch):
    """mlx-lm's prompt batch whose groups take their first decode step through a
    ``DecodeStep`` (``mask_first_steps``). mlx-lm copies a prompt batch by its class
    (``split``), so every group split off keeps it."""

    make_step: Callable[[Any, Any], Any]  # (raw model, _NewRows) -> the first step's model

    def generate(self, tokens: list[list[int]]) -> Any:
        if any(len(t) != 1 for t in tokens):  # a prefill before the step: mlx-lm's own way
            return super().generate(tokens)
        raw = self.model
        self.model = type(self).make_step(raw, _NewRows(self.uids, self.logits_processors))
        try:
            batch = super().generate(tokens)
        finally:
            self.model = raw
        batch.model = raw
        return batch


def mask_first_steps(gen: Any, make_step: Callable[[Any, Any], Any]) -> None:
    """Make ``gen``'s (a ``BatchGenerator``'s) groups take their first decode step through
    ``make_step(raw model, rows)``: a ``DecodeStep`` over the new group's rows."""
    cls = type("FirstStepPrompts", (FirstStepPrompts,), {"make_step": staticmethod(make_step)})
    gen._prompt_batch.__class__ = cls
