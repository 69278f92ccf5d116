"""One sequence decoded alone, on a plain KV cache: mlx-lm's ``generate_step`` path.

mlx-lm's BatchGenerator keeps every sequence in a batched cache with per-sequence offsets
and an attention mask, which a batch of one pays for too: on a GPU its step for a lone
stream costs about a third more than ``generate_step``'s, and its prefill is slower still.
So a request that arrives at an idle engine runs on ``SoloRunner``, with its sampler and
logits processors (penalties, ``ignore_eos``, grammars) applied exactly as the batch
applies them: the processors see the same token context (prompt, then generated tokens),
the sampler the same normalised log-probabilities, so greedy and seeded output is the
batch's. When a second request comes, ``LoneFirstRunner`` hands the sequence (its cache,
the tokens in it, the next token to feed, its sampler and processors) over to the
``BatchRunner``, which continues it like a prefix-cache hit.

Decoding is pipelined like ``generate_step``: the step after a token is queued on the GPU
before the token is read. A grammar (``response_format``, an enforced tool call) is driven a
step at a time as the batch drives its rows' (``GrammarMasks``) once its first token is
sampled: the pass is queued, then the token it feeds is read (the previous step's sample,
queued already) and the mask filled while the device runs the pass. Through mlx-lm's
processor signature the same read needs the token context, an array of its own to evaluate
every step: one more launch per token, which on a GPU is a host-bound lone stream's cost.

With cores to spare (``fill_beside``) that read and the fill run on the masks' worker
thread while this one launches the pass: on a GPU the launch of a small model's pass is
host work of about a millisecond (which lets go of the interpreter lock), so the fill no
longer adds to a host-bound stream's step. The worker reads a copy of the token made in the
step that sampled it (``mx.stop_gradient``: no kernel, an array of its own), so that no
array is touched by two threads at once: this thread's launch walks the pass's graph, which
holds the token itself.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol, cast

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import TokenBuffer

from mlx_server.engine.grammar.masks import BatchGrammar, GrammarMasks, default_threads
from mlx_server.engine.runners.base import Insert, KVState, Progress, Response, Runner
from mlx_server.engine.runners.batch import BatchRunner
from mlx_server.engine.runners.batch_step import row_grammar
from mlx_server.engine.runners.chunked_prefill import ChunkedPrefill
from mlx_server.engine.sampling.logprobs import Picked, pick
from mlx_server.engine.sampling.samplers import LogitsProcessor, Sampler

# What BatchRunner.join takes: uid, segments to feed, cache, tokens in it, tokens left to
# generate, sampler, processors, the alternatives its log-probabilities list (-1: none asked).
Handover = tuple[int, list[list[int]], Any, list[int], int, Sampler, list[LogitsProcessor], int]


class SoloSequence(ChunkedPrefill):
    """A lone sequence's prefill and decode; see the module docstring."""

    def __init__(
        self,
        model: Any,
        job: Insert,
        eos: list[int],
        prefill_step_size: int,
        buckets: bool = False,
        masks: GrammarMasks | None = None,
        fill_beside: bool = False,
    ):
        """``masks``: drive a grammar among the processors a step at a time (see the module
        docstring) from its second token on; None: through its processor call.
        ``fill_beside``: read the fed token and fill its mask on the masks' worker thread
        while this one launches the pass."""
        super().__init__(
            model,
            job.uid,
            job.prompt,
            job.cached,
            job.cache,
            prefill_step_size=prefill_step_size,
            pauses=job.pauses,
            buckets=buckets,
        )
        self.sampler = job.sampler
        self.processors = list(job.processors)  # all of them, as handed over to the batch
        self._masks = masks
        found = row_grammar(self.processors) if masks is not None else None
        self._grammar: BatchGrammar | None = found.grammar if found is not None else None
        self._others = [p for p in self.processors if found is None or p is not found.listed]
        self._sampled = False  # a first token: from now on a grammar is stepped, not called
        self._beside = fill_beside and self._grammar is not None
        # the worker's copy of the token the next step feeds (made by ``_forward``, launched
        # with the token by ``_queue_step``)
        self._probe: mx.array | None = None
        self._max_tokens = job.request.max_tokens
        self._eos = set(eos)
        self._context: TokenBuffer | None = None  # the processors' view: prompt + generated
        # sampled, not yet read: the token, the row's log-probabilities, and for a request
        # with ``logprobs`` their figures, made in the same graph (``logprobs.pick``)
        self._next: tuple[mx.array, mx.array, Picked | None] | None = None
        request = job.request
        self._top_k = request.top_logprobs if request.logprobs else -1
        self.emitted = 0

    def next(self) -> tuple[list[Progress], list[Response]]:
        with mx.stream(generation_stream):
            if len(self._todo) > 1:
                return [self._prefill_chunk()], []
            return [], [self._decode()]

    def _decode(self) -> Response:
        """One token, the next step queued before it is read."""
        if self._next is None:  # the prompt's (or a handover's) last token: the first sample
            self._next = self._forward(mx.array(self._todo))
            # Queued whole before the next step is built on it, as every later sample is:
            # ranks sharing a model then meet its collectives in the same order.
            self._queue_step()
            self.fed += self._todo
            self._todo = []
        token, logprobs, picked = self._next
        self._next = self._forward(token)  # queued before this token is read
        self._queue_step()
        return self._emit(token, logprobs, fed=True, picked=picked)

    def _queue_step(self) -> None:
        """Queue the step just built: its sample and, for the worker, the sample's copy."""
        assert self._next is not None
        probe = [self._probe] if self._probe is not None else []
        mx.async_eval(*_arrays(self._next), *probe)

    @property
    def top_logprobs(self) -> int:
        """The alternatives each token's log-probabilities list (-1: none asked)."""
        return self._top_k

    def take_pending(self) -> Response | None:
        """The token sampled but not yet read (None while prefilling), as a response; the
        sequence then continues from it (``handover``)."""
        if self._next is None:
            return None
        token, logprobs, picked = self._next
        self._next = None
        self._todo = []
        r = self._emit(token, logprobs, fed=False, picked=picked)
        self._todo = [r.token]
        return r

    def settle(self) -> None:
        """Leave the cache holding exactly ``fed`` (a speculating sequence may have a pass
        queued beyond it); before the cache is taken. Nothing to do here."""

    def handover(self) -> tuple[list[int], Any, list[int], int]:
        """(tokens still to feed, cache, tokens in the cache, tokens left to generate)."""
        return self._todo, self.cache, self.fed, self._max_tokens - self.emitted

    def _forward(self, tokens: mx.array) -> tuple[mx.array, mx.array, Picked | None]:
        logits = self.model(tokens[None], cache=self.cache)[:, -1, :]
        called = self.processors
        probe, self._probe = self._probe, None
        if self._sampled and self._grammar is not None and self._masks is not None:
            logits = self._masked(tokens, probe, logits)
            called = self._others
        if called:  # as GenerationBatch._step: the context ends with the input
            if self._context is None:
                self._context = TokenBuffer(self.fed)
            context = self._context.update_and_fetch(tokens)
            for processor in called:
                logits = processor(context, logits)
        self._sampled = True
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = self.sampler(logprobs)
        if self._beside:
            self._probe = mx.stop_gradient(token)
        row = logprobs.squeeze(0)
        picked = pick(row, token, self._top_k) if self._top_k >= 0 else None
        return token, row, picked

    def _masked(self, tokens: mx.array, probe: mx.array | None, logits: mx.array) -> mx.array:
        """``logits`` masked by the grammar after it consumed the fed token (sampled and
        queued a step ago): the pass goes first, the read and the fill while the device runs
        it, on the worker thread (reading ``probe``) while this one launches, or here after."""
        masks, grammar = cast(GrammarMasks, self._masks), cast(BatchGrammar, self._grammar)
        vocab = logits.shape[-1]
        if probe is not None:
            pending = masks.submit_read(lambda: _last(probe), [grammar], vocab)
            mx.async_eval(logits)
            plan = pending.result()
        else:
            mx.async_eval(logits)
            plan = masks.plan([grammar], _last(tokens))
            plan = masks.compute(plan, vocab) if plan is not None else None
        return masks.mask(plan, logits) if plan is not None else logits

    def _emit(
        self, token: mx.array, logprobs: mx.array, fed: bool, picked: Picked | None = None
    ) -> Response:
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
            return Response(self.uid, tok, logprobs, None, picked=picked)
        return Response(self.uid, tok, logprobs, reason, self.cache, list(self.fed), picked=picked)


def _last(tokens: mx.array) -> list[int]:
    """The last of the fed tokens, read (waiting for the step that sampled it)."""
    return cast(list[int], tokens.tolist())[-1:]


def _arrays(step: tuple[mx.array, mx.array, Picked | None]) -> list[mx.array]:
    """A step's arrays to evaluate: the token, the row, and its picked figures."""
    token, row, picked = step
    return [token, row, *(picked.arrays() if picked is not None else [])]


class SoloRunner:
    """The runner of at most one sequence at a time, on a plain KV cache."""

    def __init__(
        self,
        model: Any,
        eos: list[int],
        *,
        prefill_step_size: int,
        prefill_buckets: bool = False,
        step_grammars: bool = True,
        fill_beside: bool | None = None,
    ):
        """``step_grammars=False``: a grammar runs through its processor call every step
        (what the module docstring says it costs; benchmarks compare). ``fill_beside``: a
        stepped grammar's read and fill run on the masks' worker thread while the pass is
        launched (None: where the machine has cores to spare, as the batch's masks do)."""
        self.model = model
        # one row's masks in one llguidance call, on this thread or the masks' worker
        self._masks = GrammarMasks(threads=1) if step_grammars else None
        self._beside = default_threads() > 1 if fill_beside is None else fill_beside
        self._eos = eos
        self._step_size = prefill_step_size
        self._buckets = prefill_buckets
        self.seq: SoloSequence | None = None
        self.runs = 0  # sequences started here (monitoring, and tests that the path is taken)

    def __len__(self) -> int:
        return 0 if self.seq is None else 1

    @property
    def busy(self) -> bool:
        return self.seq is not None

    def hand_over(self) -> tuple[Response | None, Handover | None]:
        """Give the sequence up to the batch: the token it sampled but has not delivered
        (None while prefilling), and what ``BatchRunner.join`` needs to continue it (None
        when there is no sequence, or that token ended it)."""
        seq, self.seq = self.seq, None
        if seq is None:
            return None, None
        pending = seq.take_pending()
        if pending is not None and pending.finish_reason is not None:
            return pending, None
        todo, cache, fed, left = seq.handover()
        rest = (seq.uid, [todo], cache, fed, left, seq.sampler, seq.processors, seq.top_logprobs)
        return pending, rest

    def insert(self, job: Insert) -> None:
        if self.seq is not None:
            raise RuntimeError("the solo runner runs one sequence at a time")
        self.seq = SoloSequence(
            self.model,
            job,
            self._eos,
            self._step_size,
            self._buckets,
            self._masks,
            fill_beside=self._beside,
        )
        self.runs += 1

    def step(self) -> tuple[list[Progress], list[Response]]:
        if self.seq is None:
            return [], []
        progress, responses = self.seq.next()
        if any(r.finish_reason is not None for r in responses):
            self.seq = None
        return progress, responses

    def remove(self, uids: list[int]) -> dict[int, KVState]:
        seq = self.seq
        if seq is None or seq.uid not in uids:
            return {}
        self.seq = None
        seq.settle()
        return {seq.uid: (seq.cache, seq.fed)}

    def extract_state(self, uids: list[int]) -> dict[int, KVState]:
        seq = self.seq
        if seq is None or seq.uid not in uids:
            return {}
        seq.settle()
        return {seq.uid: (copy.deepcopy(seq.cache), list(seq.fed))}

    def reset(self) -> None:
        self.seq = None

    def close(self) -> None:
        self.seq = None
        if self._masks is not None:
            self._masks.close()

    def stats(self) -> dict[str, Any]:
        masks = self._masks
        return {
            "solo_runs": self.runs,
            "solo_grammar_steps": masks.steps if masks is not None else 0,
            # of them, read and filled on the masks' worker thread
            "solo_grammar_fills_beside": masks.submitted if masks is not None else 0,
        }


class LoneRunner(Runner, Protocol):
    """A runner of one sequence that can give it up to the batch (``SoloRunner``; a
    speculative decoder for lone streams would be another)."""

    @property
    def busy(self) -> bool: ...

    def hand_over(self) -> tuple[Response | None, Handover | None]: ...


class LoneFirstRunner:
    """A lone request on the lone runner, every other on the batch runner; the lone one
    joins the batch when another starts. The token it had sampled but not yet delivered
    comes first in the next ``step``."""

    def __init__(self, lone: LoneRunner, batch: BatchRunner):
        self.lone = lone
        self.batch = batch
        self._early: list[Response] = []  # a handed-over sequence's pending token

    def insert(self, job: Insert) -> None:
        if job.alone and not self.lone.busy and not len(self.batch):
            self.lone.insert(job)
            return
        self._hand_over()
        self.batch.insert(job)

    def join(self, *handover: Any) -> None:
        """Continue a sequence prefilled elsewhere (``BatchRunner.join``'s arguments: a
        vision prompt) in the batch; the lone one joins the batch first."""
        self._hand_over()
        self.batch.join(*handover)

    def _hand_over(self) -> None:
        pending, rest = self.lone.hand_over()
        if pending is not None:
            self._early.append(pending)
        if rest is not None:
            self.batch.join(*rest)

    def step(self) -> tuple[list[Progress], list[Response]]:
        early, self._early = self._early, []
        if self.lone.busy:
            progress, responses = self.lone.step()
        elif len(self.batch):
            progress, responses = self.batch.step()
        else:
            progress, responses = [], []
        return progress, early + responses if early else responses

    def remove(self, uids: list[int]) -> dict[int, KVState]:
        return {**self.lone.remove(uids), **self.batch.remove(uids)}

    def extract_state(self, uids: list[int]) -> dict[int, KVState]:
        return {**self.lone.extract_state(uids), **self.batch.extract_state(uids)}

    def reset(self) -> None:
        self._early = []
        self.lone.reset()
        self.batch.reset()

    def close(self) -> None:
        self.lone.close()
        self.batch.close()

    def stats(self) -> dict[str, Any]:
        """Both runners' counters; a counter both keep (drafted tokens) is their sum."""
        lone, batch = self.lone.stats(), self.batch.stats()
        both = {k: lone[k] + batch[k] for k in lone.keys() & batch.keys()}
        return {**lone, **batch, **both}
