"""Samplers and logits processors for the sequences of a batch.

A seeded sampler carries its own PRNG key, so the same seed gives the same tokens whether
the request runs alone or inside a batch (mlx-lm's samplers draw from the global generator,
which batching would interleave); each seeded sequence gets its own. Unseeded sequences
with the same settings share one sampler object (``SamplerPool``): mlx-lm's BatchGenerator
samples the whole batch in one call when every sequence has the same sampler, and row by
row otherwise, which on a GPU costs a few kernels per sequence per step.

``ignore_eos`` is part of the sampler, not a logits processor: the end-of-sequence ids get
-inf from one row added to the log-probabilities (built once per vocabulary width). A
processor runs per sequence (a slice, the processor, a concatenation, and the token context
it is given), which on a GPU at 32 sequences costs more than the sampling itself. The
log-probabilities a request reports are then the model's own, end-of-sequence included; the
tokens sampled are those a mask before the normalisation would give.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Callable, Generator
from dataclasses import replace
from functools import partial
from typing import Any, Protocol, cast

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, make_logits_processors

from mlx_server.types import GenerationRequest, SamplingParams

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def _filters(params: SamplingParams) -> list[Callable[[mx.array], mx.array]]:
    """The truncations (top-p, min-p, top-k) applied to log-probabilities before sampling.
    Top-p and min-p take their setting as an array (``_Scalar``): one compiled kernel for
    every value, where a number baked into the kernel builds kernels per value (on CUDA
    seconds each on a fresh machine). Top-k's is a shape (mlx-lm's ``apply_top_k``)."""
    filters: list[Callable[[mx.array], mx.array]] = []
    if 0 < params.top_p < 1.0:
        top_p = _Scalar(params.top_p, mx.float32)
        filters.append(lambda x: _top_p(x, top_p.get()))
    if params.min_p > 0:
        if params.min_p > 1.0:
            raise ValueError(f"min_p must be within [0, 1], got {params.min_p}")
        log_min_p = _Scalar(math.log(params.min_p))
        filters.append(lambda x: _min_p(x, log_min_p.get(x.dtype)))
    if params.top_k > 0:
        filters.append(lambda x: apply_top_k(x, params.top_k))
    return filters


class _Scalar:
    """A number as a 0-d array, made once per dtype asked for (``dtype``: fixed, else the
    caller's): an input of a compiled kernel, not a constant inside it."""

    def __init__(self, value: float, dtype: Any = None):
        self.value, self.dtype = value, dtype
        self._arrays: dict[Any, mx.array] = {}

    def get(self, dtype: Any = None) -> mx.array:
        dtype = self.dtype or dtype or mx.float32
        a = self._arrays.get(dtype)
        if a is None:
            a = self._arrays[dtype] = mx.array(self.value, dtype=dtype)
        return a


@partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)
def _draw(logprobs: mx.array, inv_temp: mx.array) -> mx.array:
    """A token per row at temperature ``1 / inv_temp`` (a 0-d array in the rows' dtype),
    from the global generator."""
    return mx.random.categorical(logprobs * inv_temp)


@mx.compile
def _top_p(logprobs: mx.array, top_p: mx.array) -> mx.array:
    """The rows' smallest set of tokens whose probability reaches ``top_p`` (float32 0-d)
    kept, the rest at -inf (the tokens tied with the last one kept stay)."""
    ascending = mx.sort(logprobs, axis=-1)
    probs = mx.exp(ascending.astype(mx.float32))
    above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = above[..., :1] + probs[..., :1]
    dropped = (above >= top_p * total).sum(axis=-1, keepdims=True)
    floor = mx.take_along_axis(ascending, dropped, axis=-1)
    return mx.where(logprobs < floor, -mx.inf, logprobs)


@mx.compile
def _min_p(logprobs: mx.array, log_min_p: mx.array) -> mx.array:
    """Tokens less likely than ``min_p`` times the row's likeliest at -inf (``log_min_p``:
    its logarithm, a 0-d array in the rows' dtype)."""
    floor = logprobs.max(axis=-1, keepdims=True) + log_min_p
    return mx.where(logprobs < floor, -mx.inf, logprobs)


def make_distribution(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    """The probabilities ``make_sampler(params)`` draws from, for log-probabilities of shape
    (n, vocab): truncated, then at the temperature (speculative rejection sampling needs
    them explicitly). Temperature must be above zero."""
    filters, inv_temp = _filters(params), _Scalar(1.0 / params.temperature)

    def distribution(logprobs: mx.array) -> mx.array:
        for f in filters:
            logprobs = f(logprobs)
        return mx.softmax(logprobs * inv_temp.get(logprobs.dtype), axis=-1)

    return distribution


def seed_key(seed: int | None) -> mx.array | None:
    """A PRNG key for a request's seed (None: the global generator). Seeds are unsigned
    64-bit; a negative one (OpenAI's seed is a signed int64) is read as its two's complement."""
    if seed is None:
        return None
    return mx.random.key(seed + (1 << 64) if seed < 0 else seed)


@mx.compile
def _categorical_keyed(logprobs: mx.array, inv_temp: mx.array, key: mx.array) -> mx.array:
    """``_draw`` with a PRNG key of the request's own (one fused kernel)."""
    return mx.random.categorical(logprobs * inv_temp, key=key)


def ban_tokens(token_ids: tuple[int, ...] | list[int]) -> Callable[[mx.array], mx.array]:
    """Log-probabilities with ``token_ids`` at -inf: one added row over the vocabulary, made
    on the first call for each width and dtype met (ids past the width are left out)."""
    ids = sorted(set(token_ids))
    rows: dict[tuple[int, mx.Dtype], mx.array] = {}

    def ban(logprobs: mx.array) -> mx.array:
        width, dtype = logprobs.shape[-1], logprobs.dtype
        row = rows.get((width, dtype))
        if row is None:
            row = mx.zeros((width,), dtype=dtype)
            inside = [i for i in ids if i < width]
            if inside:
                row[mx.array(inside)] = -float("inf")
            mx.eval(row)
            rows[(width, dtype)] = row
        return logprobs + row

    return ban


def make_sampler(params: SamplingParams, ban: tuple[int, ...] = ()) -> Sampler:
    """A sampler over log-probabilities of shape (n, vocab) returning token ids of shape
    (n,); it never picks the ids in ``ban`` (``ignore_eos``)."""
    banned = ban_tokens(ban) if ban else None
    if params.temperature <= 0:
        if banned is None:
            return _greedy
        return lambda logprobs: _greedy(banned(logprobs))
    filters: list[Callable[[mx.array], mx.array]] = [banned] if banned is not None else []
    filters += _filters(params)
    # the temperature as an input of the compiled draw: one kernel for every temperature
    inv_temp = _Scalar(1.0 / params.temperature)
    seeded = seed_key(params.seed)
    key = [seeded] if seeded is not None else None

    def sample(logprobs: mx.array) -> mx.array:
        for f in filters:
            logprobs = f(logprobs)
        if key is None:  # from the global generator
            return _draw(logprobs, inv_temp.get(logprobs.dtype))
        key[0], sub = mx.random.split(key[0])
        return _categorical_keyed(logprobs, inv_temp.get(logprobs.dtype), sub)

    return sample


# The sampling settings whose kernels the warm-up builds, the likeliest first (values share
# their kernels, ``_Scalar``; top-k's value is a shape): a temperature alone, with top-p,
# greedy with an id banned (``ignore_eos``), min-p, a seed, top-k 40. Greedy alone is the
# first token's argmax. On a fresh CUDA machine each costs seconds of kernel builds that the
# first request with those settings would otherwise wait for.
WARM_SETTINGS: tuple[tuple[SamplingParams, tuple[int, ...]], ...] = (
    (SamplingParams(temperature=0.7), ()),
    (SamplingParams(temperature=0.7, top_p=0.95), ()),
    (SamplingParams(temperature=0.0), (0,)),
    (SamplingParams(temperature=0.7, min_p=0.05), ()),
    (SamplingParams(temperature=0.7, seed=0), ()),
    (SamplingParams(temperature=0.7, top_k=40), ()),
)


def warm_sampler(
    params: SamplingParams, ban: tuple[int, ...], vocab: int, dtype: Any
) -> Generator[None, None, None]:
    """A warm-up piece: ``params``' sampler run once on a row of ``vocab`` logits in
    ``dtype`` (the model's); its one step is its whole work."""
    mx.eval(make_sampler(params, ban)(mx.zeros((1, vocab), dtype=dtype)))
    yield from ()


class SharedSampler:
    """One sampler used by every running sequence with the same unseeded settings. If it
    raises, ``fault`` says why and every sequence using it is ended by the engine (the
    step goes on with a greedy choice)."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self.fault: str | None = None

    def __call__(self, logprobs: mx.array) -> mx.array:
        if self.fault is None:
            try:
                return self.sampler(logprobs)
            except Exception as e:
                self.fault = f"sampling failed: {type(e).__name__}: {e}"
        return _greedy(logprobs)


class SamplerPool:
    """Shared samplers by sampling settings, the most recently used ``size`` of them."""

    def __init__(self, size: int = 64):
        self.size = size
        self._shared: OrderedDict[tuple[SamplingParams, tuple[int, ...]], SharedSampler] = (
            OrderedDict()
        )

    def get(
        self, params: SamplingParams, check: Callable[[Sampler], None], ban: tuple[int, ...] = ()
    ) -> SharedSampler | None:
        """The shared sampler for ``params`` (never picking the ids in ``ban``), or None when
        the request needs its own (a seeded one). A new sampler is first run through
        ``check``; what it raises propagates, and the settings get no shared sampler."""
        if params.temperature <= 0:
            params = SamplingParams(temperature=0.0)  # every greedy request: one argmax
        elif params.seed is not None:
            return None
        params = replace(
            params,
            repetition_penalty=None,
            presence_penalty=None,
            frequency_penalty=None,
            logit_bias=(),
        )
        key = (params, ban)
        shared = self._shared.get(key)
        if shared is not None and shared.fault is None:
            self._shared.move_to_end(key)
            return shared
        sampler = make_sampler(params, ban)
        check(sampler)
        shared = self._shared[key] = SharedSampler(sampler)
        self._shared.move_to_end(key)
        while len(self._shared) > self.size:
            self._shared.popitem(last=False)
        return shared


def make_processors(params: SamplingParams) -> list[Callable[[mx.array, mx.array], mx.array]]:
    """The request's logit bias, then repetition, presence and frequency penalties, as
    mlx-lm logits processors. The bias comes first because it stands for a change to the
    model's own scores (OpenAI: added to the logits before sampling); the penalties, and a
    constraint's mask after them, then see the biased logits."""
    rep = params.repetition_penalty
    bias = [logit_bias(params.logit_bias)] if params.logit_bias else []
    return bias + make_logits_processors(
        repetition_penalty=rep if rep not in (None, 1.0) else None,
        presence_penalty=params.presence_penalty or None,
        frequency_penalty=params.frequency_penalty or None,
    )


def logit_bias(bias: tuple[tuple[int, float], ...]) -> Callable[[mx.array, mx.array], mx.array]:
    """A logits processor adding a fixed bias to some token ids: one dense row over the
    vocabulary, built on the first call (when the logits' width and dtype are known) and
    then added to every step's logits in one operation. Ids past the logits' width are
    left out (the edge refuses ids outside the tokenizer's vocabulary)."""
    row: list[mx.array] = []

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        if not row:
            width = logits.shape[-1]
            ids = [i for i, _ in bias if i < width]
            dense = mx.zeros((width,), dtype=logits.dtype)
            if ids:
                values = mx.array([b for i, b in bias if i < width], dtype=logits.dtype)
                dense[mx.array(ids)] = values
            row.append(dense)
        return logits + row[0]

    return process


class _Faultable(Protocol):
    fault: str | None


class _Sequence(_Faultable, Protocol):
    shared: SharedSampler | None


def sequence_sampling(
    seq: _Sequence,
    req: GenerationRequest,
    pool: SamplerPool,
    vocab: int,
    eos: list[int],
    dtype: Any = None,
) -> tuple[Sampler, list[LogitsProcessor]]:
    """A request's sampler (which never picks an end-of-sequence id with ``ignore_eos``) and
    its logits processors (penalties, the request's own such as a grammar), each guarded so
    that its failure ends ``seq`` alone. The sampler is tried once on a row of the model's
    logits width (``vocab``) and dtype (``dtype``, the model's: float32 when unknown): one
    that cannot work fails its own request here, before it joins (and breaks) a batch. Unseeded requests with the same settings share one (``seq.shared``),
    so the batch samples in one call."""

    def check(sampler: Sampler) -> None:
        mx.eval(sampler(mx.zeros((1, vocab), dtype=dtype or mx.float32)))

    ban = tuple(eos) if req.ignore_eos else ()
    seq.shared = pool.get(req.sampling, check, ban)
    sampler: Sampler
    if seq.shared is not None:
        sampler = seq.shared
    else:
        own = make_sampler(req.sampling, ban)
        check(own)
        sampler = guard_sampler(seq, own)
    processors = list(make_processors(req.sampling)) + list(req.logits_processors)
    return sampler, [guard_processor(seq, p) for p in processors]


def guard_sampler(owner: _Faultable, sampler: Sampler) -> Sampler:
    """``sampler``, made safe to run inside a batch: if it raises, ``owner.fault`` records
    why and the step goes on with a greedy choice, so the engine can end ``owner`` alone."""

    def sample(logprobs: mx.array) -> mx.array:
        try:
            return sampler(logprobs)
        except Exception as e:
            owner.fault = owner.fault or f"sampling failed: {type(e).__name__}: {e}"
            return _greedy(logprobs)

    return sample


def guard_processor(owner: _Faultable, processor: Any) -> GuardedProcessor:
    """A logits processor that records its failure on ``owner`` instead of failing the
    batch's step; the logits pass through unchanged for that step."""
    return GuardedProcessor(owner, processor)


class GuardedProcessor:
    """``processor`` guarded for ``owner`` (see ``guard_processor``). The batch runner
    looks inside for grammars, which it masks for the whole batch at once."""

    def __init__(self, owner: _Faultable, processor: Any):
        self.owner = owner
        self.processor = processor

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.owner.fault is not None:
            return logits
        try:
            return cast(mx.array, self.processor(tokens, logits))
        except Exception as e:
            self.owner.fault = f"logits processing failed: {type(e).__name__}: {e}"
            return logits


def reset_random_state() -> None:
    """Give MLX's global generator a fresh key. A step that failed half-built can leave
    the global key pointing at an array that will never be computed, and every unseeded
    sample after it would fail."""
    mx.random.seed(int.from_bytes(os.urandom(8), "little"))
