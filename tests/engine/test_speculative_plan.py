"""Speculation is never slower than without: with nothing to accept, the draft width falls
to zero within a few steps and stays there, alone and in a batch of eight, and the output
is plain greedy decoding's; drafting comes back when drafts start matching. The step-cost
model: verify passes in a few widths, each measured (its first, compiling, pass dropped).
"""

from __future__ import annotations

import random
from typing import Any

import mlx.core as mx
import pytest
from engine_runner import load_varied_model
from mlx_lm.generate import BatchGenerator, generate_step

from mlx_server.engine.sampling.samplers import make_sampler
from mlx_server.engine.speculative import plan_log as why
from mlx_server.engine.speculative.batch import BatchSpeculator, RowSpec, install
from mlx_server.engine.speculative.controller import DraftLength
from mlx_server.engine.speculative.costs import StepCosts, bucket, widths
from mlx_server.engine.speculative.plan_log import PlanLog
from mlx_server.engine.speculative.runner import Speculation
from mlx_server.engine.speculative.sequence import SpeculativeSequence
from mlx_server.engine.speculative.shadow import Shadow
from mlx_server.types import SamplingParams

# ---- the cost model and the controller, no model -----------------------------------------


def test_passes_take_a_few_widths_and_each_is_measured_after_its_first() -> None:
    assert widths(8) == [1, 2, 4, 8] and widths(6) == [1, 2, 4, 6] and widths(0) == []
    assert [bucket(n, 8) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    c = StepCosts(8)
    assert c.cost(1, 4) is None  # no plain step measured yet
    c.record_plain(1, 0.010)
    assert not c.measured(1)  # one sample may be an outlier
    c.record_plain(1, 0.010)
    assert c.measured(1)
    assert c.cost(1, 4) == pytest.approx(0.016)  # the guess: 0.15 of a step per position
    c.record_verify(1, 8, 0.500)  # the first pass of a shape compiles: dropped
    assert c.table() == {}
    c.record_verify(1, 8, 0.018)
    assert c.table() == {1: {8: pytest.approx(1.8)}}
    assert c.cost(1, 4) == pytest.approx(0.014)  # between the plain step and width 8
    c.record_verify(1, 2, 0.5)
    c.record_verify(1, 2, 0.009)  # noise: a verifying step is never cheaper than a plain one
    assert c.cost(1, 2) == pytest.approx(0.010)
    assert c.cost(2, 2) is None  # another batch size is measured on its own


def test_a_draft_is_padded_to_a_wider_pass_measured_cheaper() -> None:
    """Kernels are not monotonic in the rows they take (a 4-bit 8B on an H200: 7 rows 4.53
    decode steps, 9 rows 2.58): a draft goes to its own width until a wider one is measured
    clearly cheaper at that batch size, then to the cheapest such."""
    c = StepCosts(8)
    for _ in range(2):
        c.record_plain(1, 0.010)
    assert [c.width(1, n) for n in (1, 3, 5)] == [1, 4, 8]  # nothing measured: the buckets
    for w, s in ((2, 0.030), (4, 0.0375), (8, 0.0219)):
        c.record_verify(1, w, 0.5)  # the first pass of a shape compiles: dropped
        c.record_verify(1, w, s)
    assert [c.width(1, n) for n in (1, 2, 3, 4, 8)] == [1, 8, 8, 8, 8]  # 1: not measured
    assert c.cost(1, 4) == pytest.approx(0.0219)  # what the plan counts is what runs
    assert c.width(2, 3) == 4  # another batch size is measured on its own
    c.record_verify(1, 4, 0.025)
    c.record_verify(1, 4, 0.025)  # now 4 is at most 1/0.8 of 8's: a draft keeps its own
    assert c.width(1, 3) == 4


def test_the_widest_default_width_runs_only_where_its_measured_cost_pays() -> None:
    """The default draft length (15) is a ceiling, not a width: a pass over 16 rows runs
    where it costs about what a narrower one does (the device is the bound: an H200's
    4-bit 8B, 9 and 16 rows 2.38 and 2.44 decode steps) and the drafts are accepted, and a
    narrower one where the pass grows with its rows (a CPU)."""
    assert Speculation().num_draft_tokens == 15 and widths(15) == [1, 2, 4, 8, 15]

    def measured(costs_ms: dict[int, float]) -> StepCosts:
        c = StepCosts(15)
        for _ in range(2):
            c.record_plain(1, 0.010)
        for w, ms in costs_ms.items():
            c.record_verify(1, w, 0.5)  # the first pass of a shape compiles: dropped
            c.record_verify(1, w, ms / 1000)
        return c

    flat = measured({1: 20.0, 2: 22.0, 4: 24.0, 8: 24.0, 15: 25.0})
    assert flat.best(1, [0.95], [15]) == 15  # twice the tokens for 4 % more
    assert flat.best(1, [0.95], [6]) == 8  # a shorter draft: no wider pass than it needs
    growing = measured({1: 12.0, 2: 14.0, 4: 16.0, 8: 22.0, 15: 34.0})
    assert growing.best(1, [0.95], [15]) == 8
    assert growing.best(1, [0.7], [15]) == 4
    assert growing.best(1, [0.2], [15]) == 0  # nothing pays


def test_a_lone_sequence_runs_the_width_its_costs_choose(tiny: Any) -> None:
    """The lone sequence's passes, queued or read one at a time, take ``StepCosts.width``:
    with width 8 measured cheaper than 4, drafts of 3 run at 8 (and the output is plain
    greedy decoding's)."""
    model, tok = tiny
    msgs = [{"role": "user", "content": "def add(a, b): return a + b"}]
    prompt = list(tok.apply_chat_template(msgs, add_generation_prompt=True))
    argmax = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    want = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=24)]

    class Three:
        def propose(self, context: list[int], k: int) -> list[int]:
            at = len(context) - len(prompt)
            return want[at : at + 3][:k]

    for pipelined in (True, False):
        costs = StepCosts(8)
        for w, s in ((1, 1.0), (1, 1.0), (4, 9.0), (4, 9.0), (8, 2.0), (8, 2.0)):
            costs.record_plain(1, 1.0) if w == 1 else costs.record_verify(1, w, s)
        lines: list[str] = []
        log = PlanLog(lines.append)
        seq = SpeculativeSequence(
            model, 1, prompt, 0, None, sampler=argmax, greedy=True, drafter=Three(),
            num_draft_tokens=8, max_tokens=24, eos=[], prefill_step_size=512,
            adaptive=False, costs=costs, log=log, pipelined=pipelined,
        )  # fmt: skip
        out: list[int] = []
        for _ in range(60):  # bounded: a step emits at least one token
            out += [r.token for r in seq.next()[1]]
            if len(out) >= 24:
                break
        assert out == want
        widths_run = {line.split()[2] for line in lines if line.startswith("verify ")}
        assert widths_run == {"width=8"}, (pipelined, widths_run)


def _drive(c: DraftLength, accepted: Any, steps: int, verify: float = 0.016) -> list[int]:
    """Widths chosen over ``steps``; a plain step costs 10 ms and a pass ``verify``; on
    plain steps a shadow draft is scored (``accepted(k)`` of it matching)."""
    ks = []
    for _ in range(steps):
        k = c.next_k()
        ks.append(k)
        if k:
            c.record(k, accepted(k), verify, k)
        else:
            c.record_plain(0.010)
            c.acceptance.observe(c.max_k, accepted(c.max_k))  # what a Shadow records
    return ks


def test_with_nothing_accepted_the_width_falls_to_zero_and_comes_back_when_drafts_match() -> None:
    log = PlanLog()
    c = DraftLength(8, shadowed=True, log=log)
    ks = _drive(c, lambda k: 0, 500)
    assert sum(1 for k in ks if k) <= 2 and not any(ks[10:])  # a GPU-like cheap pass
    assert log.steps[why.RATE] >= 470
    ks = _drive(c, lambda k: k, 30)  # the text turns to what the drafter proposes
    assert ks[-10:] == [8] * 10
    ks = _drive(c, lambda k: 0, 30)  # and away again
    assert not any(ks[6:])
    assert "rate" in log.stops[-1]  # why it stopped, with the figures behind it


def test_a_shadow_scores_the_run_of_matching_tokens() -> None:
    from mlx_server.engine.speculative.controller import Acceptance

    acc, s = Acceptance(0.0, backs_off=False), Shadow()
    s.start([5, 6, 7], acc)
    for t in (5, 6, 9):  # two accepted, then the run ends
        s.score(t, acc, None)
    assert not s.open and acc.rate == pytest.approx(0.8 * 0.36)  # 0.2, 0.36, then a miss
    assert s.due()  # a run with hits: the next shadow draft at once
    s.start([], acc)  # the drafter had nothing: no rejection, a wait as after a miss
    assert acc.rate == pytest.approx(0.8 * 0.36)
    rests = []
    for _ in range(4):  # misses in a row: the drafter is asked less and less often
        rests.append(sum(1 for _ in range(8) if not s.due()))
        s.start([1], acc)
        s.score(2, acc, None)
    assert rests == [1, 3, 7, 7]


# ---- on a tiny random-weight model ---------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    model, tokenizer, _ = load_varied_model(tmp_path_factory)
    return model, tokenizer


class GpuLikeCosts(StepCosts):
    """Step costs as a GPU measures them (a pass of width w: 1 + w/20 plain steps), in
    place of this machine's timings: the plan's decisions do not hang on its load."""

    def record_plain(self, batch: int, seconds: float) -> None:
        super().record_plain(batch, 0.010)

    def record_verify(self, batch: int, width: int, seconds: float) -> None:
        super().record_verify(batch, width, 0.010 + 0.0005 * width)


class Turncoat:
    """Drafts what the model will say (``answer``) for its first ``turn`` tokens, then
    tokens that are never the model's: drafting must start, then stop."""

    def __init__(self, prompt_len: int, answer: list[int], turn: int, vocab: int, seed: int = 0):
        self.start, self.answer, self.turn = prompt_len, answer, turn
        self.vocab, self.rng = vocab, random.Random(seed)
        self.calls = 0

    def propose(self, context: list[int], k: int) -> list[int]:
        self.calls += 1
        at = len(context) - self.start
        if at < self.turn:
            return self.answer[at : at + k]
        # Never the model's token (a random one could be, in a tiny vocabulary).
        return [
            (t + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
            for t in self.answer[at : at + k]
        ]


def _greedy(x: mx.array) -> mx.array:
    return mx.argmax(x, axis=-1)


def _prompt(tokenizer: Any, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True))


def test_a_lone_sequence_stops_drafting_within_two_steps_and_decodes_plainly(tiny: Any) -> None:
    model, tok = tiny
    prompt = _prompt(tok, "def add(a, b): return a + b")
    steps = generate_step(mx.array(prompt), model, max_tokens=64, sampler=_greedy)
    want = [int(t) for t, _ in steps]
    trace: list[str] = []  # traced: each verifying step's phases timed alone
    log = PlanLog(trace=trace.append)
    drafter = Turncoat(len(prompt), want, 24, int(model.args.vocab_size))
    seq = SpeculativeSequence(
        model, 1, prompt, 0, None, sampler=_greedy, greedy=True, drafter=drafter,
        num_draft_tokens=8, max_tokens=64, eos=[], prefill_step_size=512, log=log,
        costs=GpuLikeCosts(8),
    )  # fmt: skip
    got: list[int] = []
    verified_at: list[int] = []  # tokens emitted before each verifying step
    for _ in range(300):  # bounded: every step emits a token
        before = log.verify_steps
        _, responses = seq.next()
        if log.verify_steps > before:
            verified_at.append(len(got))
        got += [r.token for r in responses]
        if responses and responses[-1].finish_reason is not None:
            break
    assert got == want
    assert log.accepted > 0  # it drafted while the drafts were the model's
    ends = [line for line in trace if line.startswith("  verified in ")]
    assert len(ends) == log.verify_steps > 0
    assert all(all(p in e for p in ("forward", "decide", "roll back", "other")) for e in ends)
    assert len([n for n in verified_at if n >= 24]) <= 2  # after the turn: two failed tries
    assert log.steps[why.RATE] > 20 and log.shadow_drafted > 0


def test_eight_rows_stop_drafting_within_two_steps_and_decode_plainly(tiny: Any) -> None:
    model, tok = tiny
    texts = ["def add(a, b):", "The quick brown fox.", "Hello world!", "Paris is", "1 2 3"]
    prompts = [_prompt(tok, texts[i % len(texts)] + " " * i) for i in range(8)]
    n, turn = 48, 16
    greedy = [make_sampler(SamplingParams(temperature=0.0))] * 8

    trace: list[str] = []  # the turncoats' run is traced: each step's phases timed alone

    def run(drafters: list[Any] | None) -> tuple[list[list[int]], PlanLog, list[int]]:
        gen = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
        log = PlanLog(trace=trace.append if drafters else None)
        spec = BatchSpeculator(8, log=log, costs=GpuLikeCosts(8))
        install(gen, spec)
        uids = gen.insert(prompts, max_tokens=[n] * 8, samplers=greedy)
        for u, d in zip(uids, drafters or [], strict=False):
            spec.rows[u] = RowSpec(d)
        out: dict[int, list[int]] = {u: [] for u in uids}
        verified_at: list[int] = []  # the fewest tokens any row had before a verifying step
        for _ in range(10 * n):  # bounded: each step answers every row
            before = log.verify_steps
            least = min(len(v) for v in out.values())
            responses = gen.next_generated()
            if log.verify_steps > before:
                verified_at.append(least)
            for r in responses:
                out[r.uid].append(r.token)
            if all(len(v) == n for v in out.values()):
                break
        gen.close()
        return [out[u] for u in uids], log, verified_at

    want, _, _ = run(None)
    vocab = int(model.args.vocab_size)
    turncoats = [
        Turncoat(len(p), w, turn, vocab, seed=i)
        for i, (p, w) in enumerate(zip(prompts, want, strict=True))
    ]
    got, log, verified_at = run(turncoats)
    assert got == want
    assert log.accepted > 0
    starts = [line for line in trace if line.startswith("verify batch=8")]
    ends = [line for line in trace if line.startswith("  verified in ")]
    assert len(starts) == len(ends) == log.verify_steps > 0
    assert all(all(p in e for p in ("forward", "decide", "roll back", "other")) for e in ends)
    assert len([m for m in verified_at if m >= turn]) <= 2  # after the turn: two failed tries
    assert log.steps[why.RATE] > 10 and log.shadow_drafted > 0


class Gappy:
    """Drafts what the model will say, except at ``gaps`` (positions of the answer where
    it has nothing to propose: a code edit's new names)."""

    def __init__(self, prompt_len: int, answer: list[int], gaps: set[int]):
        self.start, self.answer, self.gaps = prompt_len, answer, gaps

    def propose(self, context: list[int], k: int) -> list[int]:
        at = len(context) - self.start
        return [] if at in self.gaps else self.answer[at : at + k]


def test_rows_with_nothing_to_propose_at_a_drafting_step_keep_their_rates(tiny: Any) -> None:
    """In a batch, a row whose drafter has nothing at a drafting step pauses and keeps its
    rate, as a lone sequence does (rejections set it to 0): drafting goes on after each
    gap, and the output is plain greedy decoding's."""
    model, tok = tiny
    texts = ["def add(a, b):", "The quick brown fox.", "Hello world!", "Paris is"]
    prompts = [_prompt(tok, t) for t in texts]
    n = 64
    greedy = [make_sampler(SamplingParams(temperature=0.0))] * len(prompts)
    gaps = {g + d for g in range(12, n, 12) for d in range(4)}  # 4 of every 12 positions

    def run(gappy: bool) -> tuple[list[list[int]], PlanLog, list[float]]:
        gen = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
        log = PlanLog()
        spec = BatchSpeculator(8, log=log, costs=GpuLikeCosts(8))
        install(gen, spec)
        uids = gen.insert(prompts, max_tokens=[n] * len(prompts), samplers=greedy)
        for u, p, w in zip(uids, prompts, want or [], strict=False):
            spec.rows[u] = RowSpec(Gappy(len(p), w, gaps if gappy else set()))
        out: dict[int, list[int]] = {u: [] for u in uids}
        lowest: list[float] = []  # the lowest rate among the rows, after each step
        for _ in range(10 * n):  # bounded: each step answers every row
            for r in gen.next_generated():
                out[r.uid].append(r.token)
            if spec.rows and log.verify_steps:
                lowest.append(min(s.record.rate for s in spec.rows.values()))
            if all(len(v) == n for v in out.values()):
                break
        gen.close()
        return [out[u] for u in uids], log, lowest

    want: list[list[int]] = []
    want, _, _ = run(False)
    got, log, lowest = run(True)
    assert got == want
    assert log.accepted >= n * len(prompts) // 2  # drafting went on past every gap
    assert all(b >= a for a, b in zip(lowest, lowest[1:], strict=False))  # no rate ever fell
    assert log.steps[why.PAUSED] > 0  # the steps the gaps paused are logged as such


def test_a_try_with_nothing_to_propose_pauses_without_lowering_the_rate() -> None:
    """A shadowed drafter with nothing to propose at a drafting step (a code edit's new
    name): the rate stays, the sequence decodes plainly 1, then 2, 4, 8 steps (asking costs
    a step its pipelining), and a verified draft starts the pauses over. A draft model's
    empty try is still a failure (it backs off)."""
    from mlx_server.engine.speculative.controller import Acceptance

    acc = Acceptance(0.9, backs_off=False)
    waits = []
    for _ in range(5):
        acc.nothing()
        waits.append(acc.wait)
        while not acc.ready:
            acc.tick()
            assert not acc.due  # a shadowed drafter never probes
    assert waits == [1, 2, 4, 8, 8] and acc.rate == 0.9 and acc.fails == 0
    acc.record(4, 4)
    acc.nothing()
    assert acc.wait == 1

    c = DraftLength(8, shadowed=True)
    c.acceptance.rate = 0.9
    c.record(0, 0, 0.0)
    assert c.rate == 0.9 and not c.acceptance.ready
    model = DraftLength(8, shadowed=False)
    model.record(0, 0, 0.0)
    model.record(0, 0, 0.0)
    assert model.acceptance.wait == 4 and model.rate < 0.6  # backed off, as before
