"""The batch runner's decode step (``runners/batch_step.py``): processors run on the rows that
have some and each distinct sampler draws for all its rows in one call, with the tokens
mlx-lm's own row-by-row step gives, greedy, seeded, penalised and biased rows mixed in one
batch, a row joining late and one leaving early."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from engine_runner import load_varied_model

from mlx_server.engine.runners.batch import BatchRunner
from mlx_server.engine.sampling.rows import process_rows, sample_by_group
from mlx_server.engine.sampling.samplers import SharedSampler, make_processors, make_sampler
from mlx_server.types import SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    model, tokenizer, _ = load_varied_model(tmp_path_factory)
    return model, tokenizer


PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.9, top_p=0.9, seed=7),
    SamplingParams(temperature=0.0),  # shares the first row's sampler
    SamplingParams(temperature=0.7, seed=3, presence_penalty=0.5, logit_bias=((5, 3.0),)),
]


class Counted:
    """A sampler that records how many rows each call draws for."""

    def __init__(self, sampler: Any, calls: list[int]):
        self.sampler, self.calls = sampler, calls

    def __call__(self, logprobs: mx.array) -> mx.array:
        self.calls.append(logprobs.shape[0])
        return self.sampler(logprobs)


def _decode(model: Any, tok: Any, by_group: bool) -> tuple[dict[int, list[int]], list[int]]:
    """Each row's tokens, and the row counts of the shared greedy sampler's calls."""
    calls: list[int] = []
    greedy = Counted(SharedSampler(make_sampler(PARAMS[0])), calls)
    runner = BatchRunner(model, [], max_batch_size=8, prefill_step_size=64, by_group=by_group)
    limits = [24, 24, 24, 10, 24]  # the fourth row leaves early
    out: dict[int, list[int]] = {i: [] for i in range(len(PARAMS))}

    def join(i: int) -> None:
        p = PARAMS[i]
        sampler = greedy if p == PARAMS[0] else make_sampler(p)
        prompt = tok.encode(f"Row {i}: the quick brown fox jumps over the lazy dog")
        runner.join(i, [prompt], None, [], limits[i], sampler, make_processors(p))

    for i in range(4):
        join(i)
    for step in range(40):
        if step == 3:
            join(4)  # joins the running batch
        for r in runner.step()[1]:
            out[r.uid].append(r.token)
        if not len(runner):
            break
    runner.close()
    return out, calls


def test_grouped_rows_decode_as_mlx_lms_row_by_row_step(tiny: Any) -> None:
    model, tok = tiny
    want, per_row = _decode(model, tok, by_group=False)
    got, grouped = _decode(model, tok, by_group=True)
    assert [len(got[i]) for i in range(5)] == [24, 24, 24, 10, 24]
    assert got == want
    # mlx-lm draws row by row in a mixed batch; the step draws the greedy rows in one call
    # over the whole batch (shapes that depend on the batch size alone).
    assert set(per_row) == {1} and max(grouped) >= 4


def test_sample_by_group_puts_each_groups_tokens_back_in_row_order() -> None:
    def constant(v: int) -> Any:
        return lambda lp: mx.full((lp.shape[0],), v, dtype=mx.uint32)

    a, b, c = constant(1), constant(2), constant(3)
    tokens = sample_by_group([a, b, a, c, b, a], mx.zeros((6, 8)))
    assert tokens.tolist() == [1, 2, 1, 3, 2, 1]
    assert sample_by_group([a, a], mx.zeros((2, 8))).tolist() == [1, 1]


def test_process_rows_leaves_rows_without_processors_untouched() -> None:
    from mlx_lm.models.cache import TokenBuffer

    seen: list[list[int]] = []

    def add_one(tokens: mx.array, logits: mx.array) -> mx.array:
        seen.append(tokens.tolist())
        return logits + 1

    for n in (3, 8):  # many rows of the batch processed (a concatenation), a few (a where)
        seen.clear()
        fed = mx.arange(n) + 7
        out = process_rows(mx.zeros((n, 4)), fed, [(1, [add_one], TokenBuffer([5]))])
        assert out.tolist() == [[0] * 4] + [[1] * 4] + [[0] * 4] * (n - 2)
        assert seen == [[5, 8]]  # the row's context, then the token fed this step
