"""Speculation inside continuous batching, as a library: mlx-lm's ``BatchGenerator`` with
the speculating generation batch installed, against the same generator without it.

Rows draft from an oracle (what plain decoding will say, wrong every few positions), each
row its own draft length, some rows not at all; every row's tokens must be plain batched
decoding's, and after every step each row's KV cache must hold exactly its tokens.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from engine_runner import load_varied_model
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache

from mlx_server.engine.sampling.samplers import make_processors, make_sampler
from mlx_server.engine.speculative.batch import BatchSpeculator, RowSpec, install
from mlx_server.engine.speculative.batch_verify import roll_back
from mlx_server.engine.speculative.controller import BatchPlan
from mlx_server.engine.speculative.costs import StepCosts
from mlx_server.engine.speculative.plan_log import PlanLog
from mlx_server.types import SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    model, tokenizer, _ = load_varied_model(tmp_path_factory)
    return model, tokenizer


def _prompt(tokenizer: Any, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True))


TEXTS = [
    "def add(a, b): return a + b",
    "The quick brown fox. The quick brown fox.",
    "Hello world!",
    "Paris is the capital of France",
]


class Oracle:
    """Drafts the row's known continuation, at most ``k`` tokens, with a wrong token at
    every ``wrong_every``-th position (0: never)."""

    def __init__(self, prompt_len: int, answer: list[int], k: int, wrong_every: int = 0):
        self.start, self.answer, self.k, self.wrong_every = prompt_len, answer, k, wrong_every
        self.calls = 0

    def propose(self, context: list[int], k: int) -> list[int]:
        self.calls += 1
        at = len(context) - self.start
        out = self.answer[at : at + min(k, self.k)]
        w = self.wrong_every
        return [t + 1 if w and (at + i) % w == 0 else t for i, t in enumerate(out)]


ACCEPTED: list[list[int]] = []


def _run(
    model: Any,
    prompts: list[list[int]],
    max_tokens: list[int],
    *,
    drafters: list[Any] | None = None,
    samplers: list[Any] | None = None,
    processors: list[Any] | None = None,
    eos: tuple[int, ...] = (),
    k: int = 4,
    spec: BatchSpeculator | None = None,
) -> tuple[list[list[int]], list[str]]:
    """Each row's tokens and finish reason; with ``drafters``, ``ACCEPTED`` holds each
    row's drafted and accepted counts."""
    gen = BatchGenerator(
        model,
        completion_batch_size=8,
        prefill_batch_size=8,
        stop_tokens=[[t] for t in eos] or None,
    )
    spec = spec or BatchSpeculator(k, adaptive=False)
    if drafters is not None:
        install(gen, spec)
    uids = gen.insert(
        prompts, max_tokens=max_tokens, samplers=samplers, logits_processors=processors
    )
    for uid, d in zip(uids, drafters or [], strict=False):
        if d is not None:
            spec.rows[uid] = d if isinstance(d, RowSpec) else RowSpec(d)
    out: dict[int, list[int]] = {u: [] for u in uids}
    reasons: dict[int, str] = {}
    tally = {u: [0, 0] for u in uids}
    ACCEPTED[:] = [tally[u] for u in uids]
    for _ in range(10 * max(max_tokens) + 50):  # bounded: each step answers every row
        responses = gen.next_generated()
        for uid, (drafted, accepted) in spec.counts.items():
            tally[uid][0] += drafted
            tally[uid][1] += accepted
        for r in responses:
            assert r.uid not in reasons, "a token after the row finished"
            out[r.uid].append(r.token)
            if r.finish_reason is not None:
                reasons[r.uid] = r.finish_reason
                assert r.all_tokens[-len(out[r.uid]) :] == out[r.uid]
                assert r.prompt_cache[0].offset == len(r.all_tokens)
        _check_caches(gen)
        if len(reasons) == len(uids):
            gen.close()
            return [out[u] for u in uids], [reasons[u] for u in uids]
    raise AssertionError("the batch did not finish")


def _check_caches(gen: BatchGenerator) -> None:
    """Each running row's cache holds exactly the tokens the batch says it holds."""
    batch = gen._generation_batch
    for i in range(len(batch.uids)):
        assert batch.extract_cache(i)[0].offset == len(batch.tokens[i])


def _greedy_samplers(n: int) -> list[Any]:
    return [make_sampler(SamplingParams(temperature=0.0))] * n


def test_rows_with_their_own_draft_lengths_and_rows_without_give_plain_output(tiny: Any) -> None:
    model, tok = tiny
    prompts = [_prompt(tok, t) for t in TEXTS]
    n = [40, 33, 40, 25]
    want, why = _run(model, prompts, n)
    drafters = [
        Oracle(len(prompts[0]), want[0], k=4),  # always right
        Oracle(len(prompts[1]), want[1], k=2, wrong_every=4),  # shorter, sometimes wrong
        None,  # never drafts
        Oracle(len(prompts[3]), want[3], k=4, wrong_every=1),  # always wrong
    ]
    got, got_why = _run(model, prompts, n, drafters=drafters)
    assert got == want and got_why == why
    (d0, a0), (d1, a1), (d2, _), (d3, a3) = ACCEPTED
    assert a0 == d0 > 20 and 0 < a1 < d1 and d2 == 0 and a3 == 0 < d3


def test_the_batch_pads_its_drafts_to_a_wider_pass_measured_cheaper(tiny: Any) -> None:
    """The batch's width, like the lone sequence's, is ``StepCosts.width``: with width 8
    measured cheaper than 4 at two rows, drafts of 3 run in passes of 8 (a 4-bit 8B on an
    H200: 7 rows 4.53 decode steps, 9 rows 2.58), and the output is plain decoding's."""
    model, tok = tiny
    prompts = [_prompt(tok, t) for t in TEXTS[:2]]
    n = [30, 30]
    want, why = _run(model, prompts, n)
    costs = StepCosts(8)
    for w, s in ((0, 1.0), (0, 1.0), (4, 9.0), (4, 9.0), (8, 2.0), (8, 2.0)):
        costs.record_plain(2, s) if w == 0 else costs.record_verify(2, w, s)
    lines: list[str] = []
    spec = BatchSpeculator(8, adaptive=False, costs=costs, log=PlanLog(lines.append))
    drafters = [Oracle(len(p), a, k=3) for p, a in zip(prompts, want, strict=True)]
    got, got_why = _run(model, prompts, n, drafters=drafters, spec=spec)
    assert got == want and got_why == why
    threes = [line for line in lines if line.startswith("verify batch=2 ") and "[3, 3]" in line]
    assert threes and all(" width=8 " in line for line in threes), threes


def test_an_end_token_and_max_tokens_inside_an_accepted_draft_end_the_row_there(
    tiny: Any,
) -> None:
    model, tok = tiny
    prompts = [_prompt(tok, t) for t in TEXTS]
    free, _ = _run(model, prompts, [30] * 4)
    eos = (free[1][9],)  # a token row 1 says mid-way, inside some draft
    n = [7, 30, 2, 13]  # limits that fall inside drafts of 4
    want, why = _run(model, prompts, n, eos=eos)
    assert "stop" in why and "length" in why
    drafters = [Oracle(len(p), w + [0] * 8, k=4) for p, w in zip(prompts, free, strict=True)]
    got, got_why = _run(model, prompts, n, drafters=drafters, eos=eos)
    assert (got, got_why) == (want, why)


def test_penalties_and_seeded_samplers_decide_as_plain_batched_decoding(tiny: Any) -> None:
    """Processors and a seed's sampler are called once per emitted token, in order."""
    model, tok = tiny
    prompts = [_prompt(tok, t) for t in TEXTS]
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, seed=3, presence_penalty=0.5),
    ]

    def fresh() -> tuple[list[Any], list[Any]]:
        return [make_sampler(p) for p in params], [make_processors(p) for p in params]

    n = [30] * 4
    samplers, procs = fresh()
    want, _ = _run(model, prompts, n, samplers=samplers, processors=procs)
    samplers, procs = fresh()
    drafters = [Oracle(len(p), w, k=3, wrong_every=4) for p, w in zip(prompts, want, strict=True)]
    got, _ = _run(model, prompts, n, drafters=drafters, samplers=samplers, processors=procs)
    assert got == want


@pytest.mark.parametrize("gpu", [False, True], ids=["slices", "gather"])
def test_roll_back_turns_each_rows_rejected_tail_into_left_padding(gpu, monkeypatch) -> None:
    from mlx_server.engine.speculative import batch_verify

    monkeypatch.setattr(batch_verify, "on_gpu", lambda: gpu)  # the CPU's way, and the GPU's
    pads, drop, steps = [1, 0, 2], [2, 4, 1], 6
    cache = BatchKVCache(pads)
    keys = mx.arange(3 * steps, dtype=mx.float32).reshape(3, 1, steps, 1)
    cache.update_and_fetch(keys, keys)
    roll_back([cache], drop)  # the common 1 trimmed, the rest rolled into padding
    k, _ = cache.keys_and_values()
    assert k.shape[2] == steps - 1
    rows, lp = k[:, 0, :, 0].tolist(), cache.left_padding.tolist()
    for i in range(3):
        real = [int(x) for x in rows[i][lp[i] :]]
        assert real == list(range(i * steps + pads[i], (i + 1) * steps - drop[i])), i
    assert cache.offset.tolist() == [steps - p - d for p, d in zip(pads, drop, strict=True)]


def test_the_batch_plan_stops_drafting_when_verifying_costs_more_than_it_yields() -> None:
    from mlx_server.engine.speculative.controller import Acceptance

    plan = BatchPlan(4)
    rows: list[Acceptance | None] = [Acceptance(0.5), None, None, None]
    plan.record_plain(4, 0.010)
    plan.record_plain(4, 0.010)
    plan.record_draft(4, 4, 0.050)  # a CPU-like cost: each drafted position a whole step
    assert not plan.worth_trying(rows)
    plan.record_draft(4, 4, 0.011)  # GPU-like: nearly free
    for _ in range(30):
        plan.record_draft(4, 4, 0.011)
    assert plan.worth_trying(rows)
    assert plan.choose(rows, [4, 0, 0, 0]) > 0
    assert plan.choose(rows, [0, 0, 0, 0]) == 0


def test_a_row_sampling_its_drafts_from_a_draft_model_is_verified_by_rejection(tiny: Any) -> None:
    """The model drafting for itself at temperature 1: the draft's distribution is the
    target's, so rejection sampling accepts (nearly) every drafted token, where drafting
    the draft model's likeliest token would be accepted at the rate of its probability."""
    from mlx_server.engine.sampling.samplers import SharedSampler, make_distribution
    from mlx_server.engine.speculative.drafters import DraftModel
    from mlx_server.engine.speculative.rejection import Draws, Rejection

    model, tok = tiny
    prompts = [_prompt(tok, t) for t in TEXTS[:2]]
    hot = SamplingParams(temperature=1.0)
    mx.random.seed(3)  # the shared sampler's draws (a position without a draft)
    row = RowSpec(DraftModel(model), rejection=Rejection(make_distribution(hot), Draws(seed=4)))
    greedy = Oracle(len(prompts[1]), [], k=0)
    samplers = [SharedSampler(make_sampler(hot)), make_sampler(SamplingParams(temperature=0))]
    got, why = _run(model, prompts, [40, 20], drafters=[row, greedy], samplers=samplers, k=3)
    assert [len(g) for g in got] == [40, 20] and why == ["length", "length"]
    (drafted, accepted), _ = ACCEPTED
    assert drafted > 20 and accepted >= 0.9 * drafted


def test_a_batch_whose_drafts_all_fail_backs_off_like_one_sequence() -> None:
    """Eight rows that never get a draft accepted, each with its own back-off and no free
    rides (a draft model's rows draft only when due): the batch reads its tokens to verify
    on a few steps of 2,000, not on every row's try."""
    from mlx_server.engine.speculative.controller import Acceptance

    plan = BatchPlan(4)
    rows: list[Acceptance | None] = [Acceptance() for _ in range(8)]
    for i, r in enumerate(rows):  # unaligned schedules
        assert r is not None
        r.wait = i
    syncs = 0
    for _ in range(2000):
        if not plan.worth_trying(rows):
            plan.record_plain(8, 0.010)
            for r in rows:
                assert r is not None
                r.tick()
            continue
        syncs += 1
        k = plan.choose(rows, [4 if r is not None and r.ready else 0 for r in rows])
        plan.record_draft(8, k, 0.011)  # GPU-like: verifying costs little
        due = [r for r in rows if r is not None and r.ready]
        for r in rows:
            assert r is not None
            r.record(k, 0) if r in due else r.tick()
        plan.record_try(len(due) * k, 0)
    assert 0 < syncs <= 14  # without the batch's own back-off: 20
