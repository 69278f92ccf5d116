"""The verify passes' shapes, warmed before they are needed.

Where MLX builds kernels per shape (CUDA: ``tuning.builds_kernels_on_first_use``), the
first verify pass of each width (``costs.widths``) at each batch size builds its kernels:
about a minute for the first on a fresh machine, a third of a second with the kernels on
disk, where the pass itself costs a few milliseconds. Paid while serving, that stalls a
request and makes the plan measure a build as the pass's cost. So the warm-up
(``tuning.WarmUp``) runs one pass of each width through the runners' own code: the lone
path's (``verify.verify``) before serving as far as the warm-up's budget allows (the
rest first in idle time: a fresh machine may spend a minute per width), the batch's (``batch.BatchSpeculator``, one
``BatchGenerator`` of its own per piece) at each batch size in idle time after that
size's decode steps. The engine's warm-up is on only where kernels are built on first use
(or when asked for), so on Metal and the CPU none of this runs.
"""

from __future__ import annotations

from collections.abc import Generator
from functools import partial
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from mlx_server.engine.core.tuning import Piece, ShapePieces
from mlx_server.engine.core.wired import hands_off
from mlx_server.engine.speculative.batch import AlwaysDraft, BatchSpeculator, RowSpec, install
from mlx_server.engine.speculative.costs import widths
from mlx_server.engine.speculative.verify import queue_pass, verify

BUDGET_S = 60.0  # seconds the verify passes add to the warm-up's budget
PROMPT = 16  # tokens before the first pass (its cache offset does not matter)
MAX_STEPS = 8  # generator steps a batch piece runs at most (prefill, first token, pass)


class Fixed:
    """A drafter that proposes ``n`` tokens, whatever the context (the pass's width)."""

    def __init__(self, n: int):
        self.n = n

    def propose(self, context: list[int], k: int) -> list[int]:
        return [1 + i % 7 for i in range(min(self.n, k))]


def what(max_k: int) -> str:
    return "verify passes of widths " + ", ".join(str(w) for w in widths(max_k))


def lone_pieces(model: Any, max_k: int) -> list[Piece]:
    """One piece per width: a lone verify pass, as ``sequence.SpeculativeSequence`` runs it."""
    return [partial(_lone, model, w) for w in widths(max_k)]


def batch_pieces(
    model: Any, max_k: int, sizes: range, max_batch_size: int, prefill_step_size: int
) -> dict[int, list[Piece]]:
    """Per batch size in ``sizes``, one piece per width: a verifying step of the batch."""
    return {
        b: [
            partial(_batch, model, max_k, b, w, max_batch_size, prefill_step_size)
            for w in widths(max_k)
        ]
        for b in sizes
    }


def shapes(first: list[Piece], later: dict[int, list[Piece]], max_k: int) -> ShapePieces:
    return ShapePieces(first=first, later=later, budget_s=BUDGET_S, what=what(max_k))


def _lone(model: Any, width: int) -> Generator[None, None, None]:
    """A pass read at once (``verify``), then one queued as a GPU queues the next pass
    behind it (``queue_pass``: its first token the choice of the pass before, an array the
    device computes; its own kernels, a dtype conversion and a concatenation among them)."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([[1 + i % 7 for i in range(PROMPT)]]), cache=cache)
    mx.eval(logits[:, -1, :], [c.state for c in cache])
    yield
    draft = [1 + i % 7 for i in range(width)]
    out = verify(model, cache, 1, draft, sampler=None)
    mx.eval(out.logprobs, [c.state for c in cache])
    yield
    first = mx.argmax(out.logprobs[-1])[None]  # what a pass's choice is: not int32
    _, logprobs, choice = queue_pass(model, cache, first, -1, draft, width, None)
    mx.eval(logprobs, choice, [c.state for c in cache])


def _batch(
    model: Any, max_k: int, size: int, width: int, max_batch_size: int, step: int
) -> Generator[None, None, None]:
    gen = BatchGenerator(
        model,
        completion_batch_size=max_batch_size,
        prefill_batch_size=max_batch_size,
        prefill_step_size=step,
        stop_tokens=[],
    )
    hands_off(gen)
    speculator = BatchSpeculator(max_k, adaptive=False, model=model)
    assert isinstance(speculator.plan, AlwaysDraft)
    install(gen, speculator)
    try:
        prompts = [[1 + (i + j) % 7 for j in range(PROMPT)] for i in range(size)]
        # room for the draft after the first token: each row's draft is ``width`` long
        for uid in gen.insert(prompts, max_tokens=[width + 3] * size):
            speculator.rows[uid] = RowSpec(Fixed(width))
        for _ in range(MAX_STEPS):
            gen.next()
            yield
            if speculator.counts:  # the verifying step ran
                return
    finally:
        gen.close()
