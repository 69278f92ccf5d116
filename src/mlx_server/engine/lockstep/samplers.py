"""Rank 0 chooses every token; the other ranks take its choice inside the same step.

Each sequence's sampler is wrapped: on rank 0 the real sampler's tokens go into an
``all_sum``, on the other ranks zeros do, so every rank feeds rank 0's tokens to the next
step (grammars, penalties, seeds and logit biases live on rank 0 alone). The sum is part of
the step's own graph: no extra round trip.

mlx-lm's ``BatchGenerator`` samples the whole batch in one call when every sequence has the
same sampler object, and row by row otherwise; the sums must be the same on every rank, so
the other ranks must see the same sharing. Rank 0 numbers each distinct sampler object (a
group) and sends the number with the sequence; every rank keeps one wrapper per group while
a sequence of the group runs.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import mlx.core as mx

from mlx_server.engine.sampling.samplers import Sampler


def leading(group: Any, sampler: Sampler) -> Sampler:
    """Rank 0's wrapper: its own tokens, shared."""

    def sample(logprobs: mx.array) -> mx.array:
        return mx.distributed.all_sum(sampler(logprobs).astype(mx.int32), group=group)

    return sample


def following(group: Any) -> Sampler:
    """Another rank's wrapper: rank 0's tokens."""

    def sample(logprobs: mx.array) -> mx.array:
        # Tied to the logits, so that this sum comes after the step's own collectives, as
        # rank 0's does (its tokens depend on the logits).
        zeros = mx.depends(mx.zeros((logprobs.shape[0],), dtype=mx.int32), logprobs)
        return mx.distributed.all_sum(zeros, group=group)

    return sample


class SamplerGroups:
    """The wrapper of each group in use, and which running sequences use it."""

    def __init__(self, wrap: Callable[[Any], Sampler]):
        self._wrap = wrap
        self._groups: dict[Hashable, tuple[Sampler, set[int], int]] = {}
        self._of: dict[int, Hashable] = {}
        self._numbers = iter(range(1 << 62))

    def join(self, uid: int, key: Hashable, source: Any) -> tuple[Sampler, int]:
        """The wrapper for the group ``key`` (made from ``source`` if the group is new) and
        the group's number."""
        entry = self._groups.get(key)
        if entry is None:
            entry = self._groups[key] = (self._wrap(source), set(), next(self._numbers))
        entry[1].add(uid)
        self._of[uid] = key
        return entry[0], entry[2]

    def leave(self, uids: list[int]) -> None:
        """Sequences that ended; a group no sequence uses is forgotten."""
        for uid in uids:
            key = self._of.pop(uid, None)
            if key is None:
                continue
            users = self._groups[key][1]
            users.discard(uid)
            if not users:
                del self._groups[key]

    def clear(self) -> None:
        self._groups.clear()
        self._of.clear()

    def __len__(self) -> int:
        return len(self._groups)
