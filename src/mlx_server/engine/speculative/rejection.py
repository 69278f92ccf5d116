"""Speculative sampling against a draft model's own probabilities.

The draft model samples each draft token from its distribution ``q`` (at the request's
temperature and truncation); the verifying pass gives the target's ``p`` at each position.
Draft token ``d_j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``; at the
first rejection a token is drawn from ``max(0, p_j - q_j)`` renormalised, and when every
draft token is accepted one more is drawn from ``p_k``. Each emitted token then has the
target's distribution (Leviathan et al., "Fast Inference from Transformers via Speculative
Decoding", 2023, appendix A.1), and a draft close to the target is accepted more often than
a greedy one: on average ``sum(min(p, q))`` per position instead of ``p(argmax q)``.

A deterministic draft (prompt lookup, a prediction, a draft model decoding greedily) is the
case ``q`` = one-hot on the draft token: accepted with probability ``p(d)``, the residual
is ``p`` without ``d``. ``verify`` does exactly that by sampling from ``p`` and comparing,
which also keeps a seeded request's tokens those of plain decoding. So rejection sampling
is used for unseeded requests with a draft model at a temperature above zero and no logits
processors (``wants_rejection``); everything else verifies as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from mlx_server.engine.sampling.samplers import make_distribution, seed_key
from mlx_server.types import SamplingParams

Distribution = Callable[[mx.array], mx.array]  # log-probabilities (n, V) -> probabilities


class Draws:
    """Random numbers for one sequence: from its seed's key, or the global generator."""

    def __init__(self, seed: int | None = None):
        self._key = seed_key(seed)

    def _sub(self) -> mx.array | None:
        if self._key is None:
            return None
        self._key, sub = mx.random.split(self._key)
        return sub

    def uniform(self, n: int) -> list[float]:
        return mx.random.uniform(shape=(n,), key=self._sub()).tolist()  # type: ignore[return-value]

    def categorical(self, probs: mx.array) -> int:
        """A token drawn from ``probs`` (vocab,), which need not be normalised."""
        return int(mx.random.categorical(mx.log(probs), key=self._sub()).item())  # type: ignore[arg-type]


@dataclass
class Rejection:
    """What a sequence needs to verify sampled drafts: the target's distribution for its
    sampling settings, and its random numbers."""

    distribution: Distribution
    draws: Draws


def wants_rejection(params: SamplingParams, has_processors: bool) -> Rejection | None:
    """Rejection sampling for these settings, or None (see the module docstring)."""
    if params.temperature <= 0 or params.seed is not None or has_processors:
        return None
    return Rejection(make_distribution(params), Draws())


def speculative_sample(p: mx.array, draft: list[int], q: mx.array, draws: Draws) -> list[int]:
    """The emitted tokens: the accepted prefix of ``draft``, then one drawn token. ``p`` is
    the target's distribution at the ``k + 1`` positions (k + 1, V), ``q`` the draft's at
    the ``k`` drafted ones (k, V)."""
    k = len(draft)
    rows, ids = mx.arange(k), mx.array(draft)
    ratio: list[float] = (p[rows, ids] / q[rows, ids]).tolist()  # type: ignore[assignment]
    u = draws.uniform(k)
    n = 0
    while n < k and u[n] < ratio[n]:
        n += 1
    rest = mx.maximum(p[n] - q[n], 0.0) if n < k else p[k]
    return [*draft[:n], draws.categorical(rest)]
