"""A batch's rows sampled and processed with work that grows with the number of distinct
settings, not with the number of rows.

mlx-lm's decode step samples the whole batch in one call only when every row has the same
sampler object; otherwise it slices each row, calls its sampler and concatenates, a few
kernels and some Python per row per step. ``sample_by_group`` calls each distinct sampler
once on the rows that use it (greedy rows: one argmax; rows sharing unseeded settings: one
draw) and puts the tokens back in row order. A seeded sampler keeps its own key, so its row
is a group of its own and draws exactly what it would draw alone.

mlx-lm's step also slices and concatenates every row as soon as one row has a logits
processor (a penalty, a bias); ``process_rows`` runs the processors of the rows that have
some and writes those rows back, leaving the others untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from mlx_server.engine.sampling.samplers import Sampler


def sample_by_group(samplers: Sequence[Sampler], logprobs: mx.array) -> mx.array:
    """Tokens for ``logprobs`` (rows × vocab), row ``i`` drawn by ``samplers[i]``, each
    distinct sampler called once. Every operation has a shape that depends on the batch
    size only, not on how its rows are grouped (where kernels are built per shape, as on
    CUDA, a regrouping builds nothing): a sampler of several rows draws over the whole
    batch and keeps its rows; a sampler of one row (a seed's) draws over that row alone,
    exactly as mlx-lm's row-by-row step calls it."""
    groups: dict[int, tuple[Sampler, list[int]]] = {}
    for i, s in enumerate(samplers):
        entry = groups.get(id(s))
        if entry is None:
            groups[id(s)] = (s, [i])
        else:
            entry[1].append(i)
    if len(groups) == 1:
        return samplers[0](logprobs)
    n = logprobs.shape[0]
    ordered = sorted(groups.values(), key=lambda g: -len(g[1]))  # the largest group first
    tokens: mx.array | None = None
    for sampler, rows in ordered:
        drawn = sampler(logprobs[rows[0] : rows[0] + 1] if len(rows) == 1 else logprobs)
        if tokens is None and len(rows) > 1:
            tokens = drawn
            continue
        if tokens is None:
            tokens = mx.zeros((n,), dtype=drawn.dtype)
        keep = set(rows)
        mine = mx.array([i in keep for i in range(n)])
        tokens = mx.where(mine, drawn.astype(tokens.dtype), tokens)
    assert tokens is not None
    return tokens


def process_rows(
    logits: mx.array,
    fed: mx.array,
    rows: Sequence[tuple[int, Sequence[Any], Any]],
) -> mx.array:
    """``logits`` (rows × vocab) with each listed row ``(i, processors, context)`` passed
    through its processors, in order, given its token context (mlx-lm's ``TokenBuffer``,
    which takes the token ``fed[i]`` first, as mlx-lm's own step does). A few rows are
    written back one ``where`` each, many by mlx-lm's own concatenation of every row: the
    shapes depend on the batch size only."""
    n = logits.shape[0]
    done: dict[int, mx.array] = {}
    for i, processors, context in rows:
        tokens = context.update_and_fetch(fed[i : i + 1])
        row = logits[i : i + 1]
        for p in processors:
            row = p(tokens, row)
        done[i] = row
    if not done:
        return logits
    if 4 * len(done) > n:
        return mx.concatenate([done.get(i, logits[i : i + 1]) for i in range(n)], axis=0)
    for i, row in done.items():
        mine = mx.array([j == i for j in range(n)])[:, None]
        logits = mx.where(mine, row.astype(logits.dtype), logits)
    return logits
