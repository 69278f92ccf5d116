"""Per-sequence samplers and logits processors.

Each sequence gets its own sampler. A seeded sampler carries its own PRNG key, so the same
seed gives the same tokens whether the request runs alone or inside a batch (mlx-lm's
samplers draw from the global generator, which batching would interleave).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from mlx_server.types import SamplingParams

Sampler = Callable[[mx.array], mx.array]


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def make_sampler(params: SamplingParams) -> Sampler:
    """A sampler over log-probabilities of shape (1, vocab) returning token ids of shape (1,)."""
    if params.temperature <= 0:
        return _greedy
    filters: list[Callable[[mx.array], mx.array]] = []
    if 0 < params.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, params.top_p))
    if params.min_p > 0:
        filters.append(lambda x: apply_min_p(x, params.min_p))
    if params.top_k > 0:
        filters.append(lambda x: apply_top_k(x, params.top_k))
    inv_temp = 1.0 / params.temperature
    # Seeds are unsigned 64-bit; a negative one (OpenAI's seed is a signed int64) is read as
    # its two's complement.
    seed = params.seed
    if seed is not None and seed < 0:
        seed += 1 << 64
    key = [mx.random.key(seed)] if seed is not None else None

    def sample(logprobs: mx.array) -> mx.array:
        for f in filters:
            logprobs = f(logprobs)
        if key is None:
            return mx.random.categorical(logprobs * inv_temp)
        key[0], sub = mx.random.split(key[0])
        return mx.random.categorical(logprobs * inv_temp, key=sub)

    return sample


def make_processors(params: SamplingParams) -> list[Callable[[mx.array, mx.array], mx.array]]:
    """Repetition, presence and frequency penalties as mlx-lm logits processors."""
    rep = params.repetition_penalty
    return make_logits_processors(
        repetition_penalty=rep if rep not in (None, 1.0) else None,
        presence_penalty=params.presence_penalty or None,
        frequency_penalty=params.frequency_penalty or None,
    )


class _Faultable(Protocol):
    fault: str | None


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


def guard_processor(owner: _Faultable, processor: Any) -> Any:
    """A logits processor that records its failure on ``owner`` instead of failing the
    batch's step; the logits pass through unchanged for that step."""

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        if owner.fault is not None:
            return logits
        try:
            return processor(tokens, logits)
        except Exception as e:
            owner.fault = f"logits processing failed: {type(e).__name__}: {e}"
            return logits

    return process


def reset_random_state() -> None:
    """Give MLX's global generator a fresh key. A step that failed half-built can leave
    the global key pointing at an array that will never be computed, and every unseeded
    sample after it would fail."""
    mx.random.seed(int.from_bytes(os.urandom(8), "little"))
