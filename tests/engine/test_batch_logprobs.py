"""Log-probabilities in the batch: each step computes the asking rows' figures (the chosen
token's log-probability and the top alternatives) in its own graph, for every row at once,
and the runner reads them once the step is done, instead of one read per row afterwards (on
a GPU each such read waits for the step already queued). The figures are those the
step's own log-probability rows give, for greedy and seeded rows, a row joining late, rows
without log-probabilities beside them."""

from __future__ import annotations

from typing import Any

import pytest
from engine_runner import load_varied_model

from mlx_server.engine.runners.base import Insert
from mlx_server.engine.runners.batch import BatchRunner
from mlx_server.engine.sampling.logprobs import PickedValues, logprob_entry
from mlx_server.engine.sampling.samplers import make_sampler
from mlx_server.types import GenerationRequest, SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    model, tokenizer, _ = load_varied_model(tmp_path_factory)
    return model, tokenizer


# (sampling, logprobs, top_logprobs) per row; the last joins three steps late
ROWS = [
    (SamplingParams(temperature=0.0), True, 0),
    (SamplingParams(temperature=0.0), True, 3),
    (SamplingParams(temperature=0.0), False, 0),
    (SamplingParams(temperature=0.8, seed=11), True, 20),
    (SamplingParams(temperature=0.0), True, 5),
]
STEPS = 12


def _job(tok: Any, i: int) -> Insert:
    params, logprobs, k = ROWS[i]
    prompt = tok.encode(f"Row {i}: a lighthouse keeper climbed the stairs")
    req = GenerationRequest(
        f"r{i}", prompt, STEPS, sampling=params, logprobs=logprobs, top_logprobs=k
    )
    return Insert(i, req, prompt, 0, None, make_sampler(params))


def test_the_batch_computes_each_asking_rows_figures_in_its_step(tiny: Any) -> None:
    model, tok = tiny
    runner = BatchRunner(model, [], max_batch_size=8, prefill_step_size=64)
    got: dict[int, list[Any]] = {i: [] for i in range(len(ROWS))}
    for i in range(4):
        runner.insert(_job(tok, i))
    for step in range(10 * STEPS):  # bounded: each decode step answers every running row
        if step == 3:
            runner.insert(_job(tok, 4))
        for r in runner.step()[1]:
            got[r.uid].append(r)
        if not len(runner) and step > 3:
            break
    runner.close()
    for i, (_, logprobs, k) in enumerate(ROWS):
        responses = got[i]
        assert len(responses) == STEPS
        picked = [r.picked for r in responses]
        if not logprobs:
            assert picked == [None] * STEPS  # nothing computed for a row that did not ask
            continue
        # Every token the batch's decode step sampled (all but the first, which the
        # prefill's own step samples) comes with its figures.
        assert all(isinstance(p, PickedValues) for p in picked[1:]), i
        for r in responses[1:]:
            from_step = logprob_entry(tok, r.token, r.logprobs, k, r.picked)
            from_row = logprob_entry(tok, r.token, r.logprobs, k)  # the per-row read
            assert from_step.logprob == pytest.approx(from_row.logprob, abs=1e-5)
            assert len(from_step.top) == len(from_row.top) == k
            for a, b in zip(from_step.top, from_row.top, strict=True):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert {t.token for t in from_step.top} == {t.token for t in from_row.top}
            # The chosen token's figure is its own: greedy picks the top alternative.
            if k and ROWS[i][0].temperature == 0.0:
                assert from_step.top[0].logprob == pytest.approx(from_step.logprob)


def test_a_lone_sequence_handed_to_the_batch_keeps_its_figures_made_in_the_step(
    tiny: Any,
) -> None:
    """A request that started alone (the lone path) and joins the batch when a second
    comes: its later tokens' figures are the batch step's too."""
    from dataclasses import replace

    from mlx_server.engine.runners.solo import LoneFirstRunner, SoloRunner

    model, tok = tiny
    runner = LoneFirstRunner(
        SoloRunner(model, [], prefill_step_size=64),
        BatchRunner(model, [], max_batch_size=8, prefill_step_size=64),
    )
    runner.insert(replace(_job(tok, 1), alone=True))  # greedy, top 3
    got: list[Any] = []
    for step in range(10 * STEPS):  # bounded: each step answers the running rows
        if step == 4:
            runner.insert(_job(tok, 2))  # no log-probabilities: the first one joins the batch
        got += [r for r in runner.step()[1] if r.uid == 1]
        if len(got) == STEPS:
            break
    runner.close()
    assert runner.lone.runs == 1 and len(got) == STEPS
    assert isinstance(got[-1].picked, PickedValues)  # made by the batch's decode step
    last = got[-1]
    from_step = logprob_entry(tok, last.token, last.logprobs, 3, last.picked)
    from_row = logprob_entry(tok, last.token, last.logprobs, 3)
    assert [t.logprob for t in from_step.top] == pytest.approx([t.logprob for t in from_row.top])
