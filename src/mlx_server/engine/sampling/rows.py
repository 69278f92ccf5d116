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
    distinct sampler called once on its rows."""
    groups: dict[int, tuple[Sampler, list[int]]] = {}
    for i, s in enumerate(samplers):
        entry = groups.get(id(s))
        if entry is None:
            groups[id(s)] = (s, [i])
        else:
            entry[1].append(i)
    if len(groups) == 1:
        return samplers[0](logprobs)
    parts, order = [], []
    for sampler, rows in groups.values():
        part = logprobs[rows[0] : rows[0] + 1] if len(rows) == 1 else logprobs[mx.array(rows)]
        parts.append(sampler(part))
        order += rows
    tokens = mx.concatenate(parts, axis=0)
    back = [0] * len(order)
    for position, row in enumerate(order):
        back[row] = position
    return tokens[mx.array(back)]


def process_rows(
    logits: mx.array,
    fed: mx.array,
    rows: Sequence[tuple[int, Sequence[Any], Any]],
) -> mx.array:
    """``logits`` (rows × vocab) with each listed row ``(i, processors, context)`` passed
    through its processors, in order, given its token context (mlx-lm's ``TokenBuffer``,
    which takes the token ``fed[i]`` first, as mlx-lm's own step does)."""
    done = []
    for i, processors, context in rows:
        tokens = context.update_and_fetch(fed[i : i + 1])
        row = logits[i : i + 1]
        for p in processors:
            row = p(tokens, row)
        done.append(row)
    if not done:
        return logits
    if len(done) == logits.shape[0]:
        return mx.concatenate(done, axis=0)
    logits[mx.array([i for i, _, _ in rows])] = mx.concatenate(done, axis=0)
    return logits
