"""Per-sequence samplers and logits processors.

Each sequence gets its own sampler. A seeded sampler carries its own PRNG key, so the same
seed gives the same tokens whether the request runs alone or inside a batch (mlx-lm's
samplers draw from the global generator, which batching would interleave).
"""

from __future__ import annotations

from collections.abc import Callable

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
    key = [mx.random.key(params.seed)] if params.seed is not None else None

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
