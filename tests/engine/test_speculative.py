"""Speculative decoding as a library: drafters, verification, rollback, exactness.

The reference for every exactness test is mlx-lm's own ``generate_step`` (plain decoding,
one token per forward pass) with the same sampler and logits processors.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest
from conftest_gguf import (  # noqa: F401  (fixtures)
    demo_f32_dir_fixture,
    demo_gguf_fixture,
)
from engine_runner import load_varied_model
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from tiny_model import FIM_SPECIALS, build_tiny_model

from mlx_server.engine.grammar.constraints import ConstraintCompiler, ConstraintSpec
from mlx_server.engine.sampling.samplers import make_processors, make_sampler
from mlx_server.engine.speculative.controller import DraftLength
from mlx_server.engine.speculative.drafters import (
    DraftModel,
    PredictedOutput,
    PromptLookup,
    check_same_tokenizer,
)
from mlx_server.engine.speculative.plan_log import PlanLog
from mlx_server.engine.speculative.sequence import SpeculativeSequence
from mlx_server.engine.speculative.verify import verify
from mlx_server.types import SamplingParams

# ---- drafters, no model ----------------------------------------------------------------


def test_prompt_lookup_proposes_what_followed_the_longest_match() -> None:
    d = PromptLookup(max_n=3)
    # "7 8 9" occurred once, followed by 1 2 3; "9" alone last occurred before 5.
    ctx = [7, 8, 9, 1, 2, 3, 4, 9, 5, 6, 7, 8, 9]
    assert d.propose(ctx, 3) == [1, 2, 3]
    assert d.propose(ctx, 0) == []
    assert d.propose([*ctx, 1, 2], 2) == [3, 4]  # grows with the context


def test_a_proposal_ahead_leaves_the_drafter_as_it_was() -> None:
    """A guess after a context not confirmed yet (a draft still being verified) does not
    move the drafter: the next real context gets what it would have got."""
    lookup, fresh = PromptLookup(), PromptLookup()
    context = [1, 2, 3, 4, 9, 1, 2, 3]
    assert lookup.propose(context, 3) == [4, 9, 1]
    assert lookup.propose_ahead([*context, 4, 9, 1, 2], 3) == [3, 4, 9]  # the guessed tail
    assert lookup.propose_ahead([7, *context], 3) == []  # a context it does not follow
    real = [*context, 5, 1]  # the draft was rejected at its first token
    fresh.propose(context, 3)
    assert lookup.propose(real, 3) == fresh.propose(real, 3) == [2, 3, 5]
    prediction = [10, 11, 12, 13, 14, 15, 16]
    pred, same = PredictedOutput(prediction, 2), PredictedOutput(prediction, 2)
    assert pred.propose([0, 1, 10, 11], 2) == same.propose([0, 1, 10, 11], 2) == [12, 13]
    assert pred.propose_ahead([0, 1, 10, 11, 12, 13], 2) == [14, 15]
    assert pred.propose([0, 1, 10, 11, 99], 2) == same.propose([0, 1, 10, 11, 99], 2)


def test_prompt_lookup_without_a_match_proposes_nothing() -> None:
    d = PromptLookup()
    assert d.propose([1, 2, 3, 4], 4) == []
    assert d.propose([5], 4) == []


def test_prompt_lookup_on_a_new_context_forgets_the_old_one() -> None:
    d = PromptLookup()
    assert d.propose([1, 2, 3, 1], 2) == [2, 3]
    assert d.propose([4, 5, 6, 4], 2) == [5, 6]
    assert d.propose([1, 9, 1], 2) == [9, 1]


def test_predicted_output_follows_the_prediction_and_realigns_after_an_edit() -> None:
    prompt = [100, 101]
    pred = [1, 2, 3, 4, 5, 6, 7, 8]
    d = PredictedOutput(pred, prompt_len=len(prompt))
    assert d.propose(prompt, 3) == [1, 2, 3]
    assert d.propose([*prompt, 1, 2], 3) == [3, 4, 5]
    # The answer changes 3 to 30 31, then goes on with 4: the cursor is found again.
    assert d.propose([*prompt, 1, 2, 30, 31], 3) == []
    assert d.propose([*prompt, 1, 2, 30, 31, 4], 3) == [5, 6, 7]
    assert d.propose([*prompt, 1, 2, 30, 31, 4, 5, 6, 7, 8], 3) == []  # the end


def _drive(c: DraftLength, steps: int, accepted: Any, t0: float, per_token: float) -> list[int]:
    """Run ``c`` for ``steps``: plain steps cost ``t0``, a draft of k ``t0 + per_token*k``,
    and ``accepted(k)`` of a draft are accepted. The draft lengths chosen, in order."""
    ks = []
    for _ in range(steps):
        k = c.next_k()
        ks.append(k)
        if k:
            c.record(k, accepted(k), t0 + per_token * k)
        else:
            c.record_plain(t0)
    return ks


def test_draft_length_stops_after_two_failures_and_backs_off_exponentially() -> None:
    c = DraftLength(4)
    # A GPU-like cost (a draft costs little): only the failures make it stop.
    ks = _drive(c, 2000, lambda k: 0, 0.010, 0.0005)
    tries = [i for i, k in enumerate(ks) if k]
    assert len(tries) <= 14  # two, then one per back-off: 4, 8, ... 256, 256, ...
    gaps = [b - a for a, b in zip(tries[1:], tries[2:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] >= 200


def test_draft_length_starts_again_when_drafts_are_accepted_again() -> None:
    c = DraftLength(4)
    _drive(c, 300, lambda k: 0, 0.010, 0.0005)  # backed off far
    ks = _drive(c, 600, lambda k: k, 0.010, 0.0005)  # the text turns repetitive
    assert ks[-100:].count(4) >= 95


def test_draft_length_stays_up_when_drafts_pay() -> None:
    c = DraftLength(6)
    ks = _drive(c, 200, lambda k: k, 0.010, 0.001)
    assert ks[-1] == 6 and ks[-100:].count(6) >= 95


def test_draft_length_drops_to_zero_when_verifying_costs_more_than_it_yields() -> None:
    c = DraftLength(4)
    # Half the drafted tokens accepted, but each costs as much as a step (a CPU).
    ks = _drive(c, 1000, lambda k: k // 2, 0.010, 0.010)
    assert ks[-500:].count(0) >= 480


# ---- on a tiny random-weight model -----------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    model, tokenizer, _ = load_varied_model(tmp_path_factory)  # greedy output that varies
    return model, tokenizer


def _prompt(tokenizer: Any, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True))


def _plain(
    model: Any, prompt: list[int], n: int, sampler: Any, processors: Any = None
) -> list[int]:
    steps = generate_step(
        mx.array(prompt), model, max_tokens=n, sampler=sampler, logits_processors=processors
    )
    return [int(t) for t, _ in steps]


class Oracle:
    """Drafts the given continuation of the prompt (what the model will say), or a wrong
    token every ``wrong_every`` positions."""

    def __init__(self, prompt_len: int, answer: list[int], wrong_every: int = 0):
        self.start, self.answer, self.wrong_every = prompt_len, answer, wrong_every

    def propose(self, context: list[int], k: int) -> list[int]:
        at = len(context) - self.start
        out = self.answer[at : at + k]
        if self.wrong_every:
            out = [t + 1 if (at + i) % self.wrong_every == 0 else t for i, t in enumerate(out)]
        return out


def _speculate(
    model: Any, prompt: list[int], n: int, drafter: Any, **kw: Any
) -> tuple[list[int], Any]:
    greedy = kw.pop("greedy", True)
    sampler = kw.pop("sampler", lambda x: mx.argmax(x, axis=-1))
    seq = SpeculativeSequence(
        model,
        1,
        prompt,
        0,
        None,
        sampler=sampler,
        greedy=greedy,
        drafter=drafter,
        num_draft_tokens=kw.pop("k", 4),
        max_tokens=n,
        eos=kw.pop("eos", []),
        prefill_step_size=kw.pop("prefill_step_size", 512),
        **kw,
    )
    out: list[int] = []
    for _ in range(10 * n + 100):  # bounded: a step emits at least one token
        _, responses = seq.next()
        # the cache holds exactly ``fed``, and a pass queued ahead (pipelined)
        assert seq.cache[0].offset == len(seq.fed) + seq.ahead
        for r in responses:
            out.append(r.token)
            if r.finish_reason is not None:
                assert r.all_tokens == seq.fed == (prompt + out)[: len(seq.fed)]
                return out, seq
    raise AssertionError("the sequence did not finish")


@pytest.mark.parametrize("wrong_every", [0, 3, 1])
def test_greedy_output_is_plain_decoding_whatever_is_drafted(tiny: Any, wrong_every: int) -> None:
    model, tok = tiny
    prompt = _prompt(tok, "def add(a, b): return a + b")
    want = _plain(model, prompt, 40, lambda x: mx.argmax(x, axis=-1))
    got, seq = _speculate(model, prompt, 40, Oracle(len(prompt), want, wrong_every), adaptive=False)
    assert got == want
    if wrong_every == 0:
        assert seq.draft_accepted == seq.draft_n > 0
        # passes queued behind the one read, none dropped but where the answer ended
        assert seq.passes_ahead > 3 and seq.passes_dropped <= 1
    if wrong_every == 3:  # no pass accepted whole: none queued behind another
        assert seq.passes_ahead == 0
    if wrong_every == 1:
        assert seq.draft_accepted == 0 < seq.draft_n


@pytest.mark.parametrize("pipelined", [True, False])
def test_queued_or_not_the_output_is_the_same(tiny: Any, pipelined: bool) -> None:
    model, tok = tiny
    prompt = _prompt(tok, "def add(a, b): return a + b")
    want = _plain(model, prompt, 40, lambda x: mx.argmax(x, axis=-1))
    drafter = Oracle(len(prompt), want, 11)  # runs of whole passes, then a rejection
    log = PlanLog()
    got, seq = _speculate(model, prompt, 40, drafter, adaptive=False, pipelined=pipelined, log=log)
    assert got == want
    assert (seq.passes_ahead > 0) == pipelined
    assert (seq.passes_dropped > 0) == pipelined  # queued behind a pass then rejected
    assert (log.queued, log.dropped) == (seq.passes_ahead, seq.passes_dropped)
    assert ("passes queued behind the one read" in log.summary()) == pipelined


def test_each_queued_pass_is_charged_its_own_launch(tiny: Any, monkeypatch: Any) -> None:
    """A pass queued behind another is built while that one is read: the time its launch
    takes is its own cost, not the pass read meanwhile's (on a GPU the wait for a queued
    pass is near nothing, so without it the plan saw such a pass as free and the one before
    as twice as dear). With a clock that only a launch advances, every pass costs one."""
    from mlx_server.engine.speculative import sequence as module

    model, tok = tiny
    prompt = _prompt(tok, "def add(a, b): return a + b")
    want = _plain(model, prompt, 40, lambda x: mx.argmax(x, axis=-1))
    clock = {"now": 0.0}
    launch = module.queue_pass

    def timed_launch(*args: Any, **kw: Any) -> Any:
        clock["now"] += 5.0
        return launch(*args, **kw)

    monkeypatch.setattr(module, "queue_pass", timed_launch)
    monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=lambda: clock["now"]))
    seq = SpeculativeSequence(
        model, 1, prompt, 0, None, sampler=lambda x: mx.argmax(x, axis=-1), greedy=True,
        drafter=Oracle(len(prompt), want), num_draft_tokens=4, max_tokens=40, eos=[],
        prefill_step_size=512, adaptive=False, pipelined=True,
    )  # fmt: skip
    samples: list[float] = []
    record = seq.length.record
    seq.length.record = lambda d, a, s, w=None: (samples.append(s), record(d, a, s, w))[1]  # type: ignore[method-assign]
    out: list[int] = []
    for _ in range(100):  # bounded: a step emits at least one token
        out += [r.token for r in seq.next()[1]]
        if len(out) >= 40:
            break
    assert out == want and seq.passes_ahead > 3
    # each pass its own launch; the last may also carry one it queued and then dropped (the
    # answer ended in it), a launch its own outcome wasted
    assert samples[:-1] == [5.0] * (len(samples) - 1) and samples[-1] in (5.0, 10.0)


def test_a_pass_queued_ahead_is_dropped_before_the_cache_is_taken(tiny: Any) -> None:
    """A handover to the batch, or a removal, takes the cache while a pass is queued beyond
    ``fed``: it is dropped first, and decoding on from the handed state is plain decoding's."""
    from mlx_server.engine.runners.solo import SoloRunner

    model, tok = tiny
    argmax = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    prompt = _prompt(tok, "system user assistant")
    want = _plain(model, prompt, 40, argmax)
    for take in ("handover", "remove"):
        seq = SpeculativeSequence(
            model, 1, prompt, 0, None, sampler=argmax, greedy=True,
            drafter=Oracle(len(prompt), want), num_draft_tokens=4, max_tokens=40, eos=[],
            prefill_step_size=512, adaptive=False,
        )  # fmt: skip
        out: list[int] = []
        for _ in range(20):  # bounded: the second verifying step has one queued
            out += [r.token for r in seq.next()[1]]
            if seq.ahead:
                break
        assert seq.ahead > 0 and seq.cache[0].offset == len(seq.fed) + seq.ahead
        if take == "handover":
            assert seq.take_pending() is None  # nothing sampled on a plain step
            todo, cache, fed, left = seq.handover()
        else:
            runner = SoloRunner(model, [], prefill_step_size=512)
            runner.seq = seq
            ((cache, fed),) = runner.remove([1]).values()
            todo, left = seq._todo, 40 - len(out)
        assert cache[0].offset == len(fed) and fed == (prompt + out)[: len(fed)]
        steps = generate_step(mx.array(todo), model, max_tokens=left, prompt_cache=cache)
        assert out + [int(t) for t, _ in steps] == want, take


def test_prompt_lookup_and_draft_model_give_plain_greedy_output(tiny: Any) -> None:
    model, tok = tiny
    prompt = _prompt(tok, "The quick brown fox. The quick brown fox. The quick")
    want = _plain(model, prompt, 48, lambda x: mx.argmax(x, axis=-1))
    got, _ = _speculate(model, prompt, 48, PromptLookup())
    assert got == want
    got, seq = _speculate(model, prompt, 48, DraftModel(model, prefill_step_size=8))
    assert got == want
    assert seq.draft_accepted == seq.draft_n > 0  # the model drafting for itself


def test_a_long_prompt_prefills_in_chunks_with_the_same_output(tiny: Any) -> None:
    model, tok = tiny
    prompt = _prompt(tok, "Numbers 0 1 2 3 4 5 6 7 8 9 " * 6)
    want = _plain(model, prompt, 24, lambda x: mx.argmax(x, axis=-1))
    got, _ = _speculate(model, prompt, 24, PromptLookup(), prefill_step_size=16)
    assert got == want


def test_predicted_output_gives_plain_greedy_output(tiny: Any) -> None:
    model, tok = tiny
    prompt = _prompt(tok, "Hello world!")
    want = _plain(model, prompt, 40, lambda x: mx.argmax(x, axis=-1))
    edited = want[:10] + [want[10] + 1, 5] + want[11:]  # the prediction has one edit
    drafter = PredictedOutput(edited, len(prompt))
    got, seq = _speculate(model, prompt, 40, drafter, k=8, adaptive=False)
    assert got == want
    # 8 drafted per step and one token of the model's own: 35 of 40 at best, less the
    # steps lost at the edit.
    assert seq.draft_accepted >= 24


@pytest.mark.parametrize("finish_at", [0, 5, 17])
def test_an_end_token_inside_an_accepted_draft_ends_there(tiny: Any, finish_at: int) -> None:
    model, tok = tiny
    prompt = _prompt(tok, "system user assistant")
    want = _plain(model, prompt, 30, lambda x: mx.argmax(x, axis=-1))
    eos = want[finish_at]
    first = want.index(eos)
    got, _ = _speculate(model, prompt, 30, Oracle(len(prompt), want), eos=[eos], adaptive=False)
    assert got == want[: first + 1]


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens_is_exact(tiny: Any, max_tokens: int) -> None:
    model, tok = tiny
    prompt = _prompt(tok, "Paris is the capital")
    want = _plain(model, prompt, max_tokens, lambda x: mx.argmax(x, axis=-1))
    got, _ = _speculate(model, prompt, max_tokens, Oracle(len(prompt), want), k=6, adaptive=False)
    assert got == want


def test_seeded_sampling_and_processors_match_plain_decoding(tiny: Any) -> None:
    """A seeded sampler and a repetition penalty are called once per emitted token, in
    order, so the sampled output equals plain decoding's with the same seed."""
    model, tok = tiny
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=11, repetition_penalty=1.3)
    prompt = _prompt(tok, "The quick brown fox jumps over the lazy dog.")
    want = _plain(model, prompt, 40, make_sampler(params), make_processors(params))
    drafts = Oracle(len(prompt), want, wrong_every=4)
    got, seq = _speculate(
        model,
        prompt,
        40,
        drafts,
        greedy=False,
        sampler=make_sampler(params),
        processors=make_processors(params),
        adaptive=False,
    )
    assert got == want
    assert 0 < seq.draft_accepted < seq.draft_n


def test_a_grammar_rejects_forbidden_drafts_and_its_state_follows_the_sequence(tiny: Any) -> None:
    model, tok = tiny
    compiler = ConstraintCompiler(tok)
    spec = ConstraintSpec.json_object()
    prompt = _prompt(tok, "Answer in JSON")
    want_proc = compiler.processor(spec)
    want = _plain(model, prompt, 30, lambda x: mx.argmax(x, axis=-1), [want_proc])
    # Drafts from prompt lookup over text the grammar mostly forbids, and wrong ones.
    proc = compiler.processor(spec)
    got, seq = _speculate(
        model,
        prompt,
        30,
        Oracle(len(prompt), want, wrong_every=3),
        processors=[proc],
        adaptive=False,
    )
    assert got == want
    assert proc.error is None and want_proc.error is None
    assert proc.consumed == want_proc.consumed
    assert seq.draft_n > seq.draft_accepted > 0


def test_a_draft_model_with_another_tokenizer_is_refused(
    tiny: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    _, tok = tiny
    other = build_tiny_model(tmp_path_factory.mktemp("spec") / "fim", specials=FIM_SPECIALS)
    _, other_tok = load(str(other))
    check_same_tokenizer(tok, tok)
    with pytest.raises(ValueError, match="tokenizer differs"):
        check_same_tokenizer(tok, other_tok)


# ---- the output distribution under sampling --------------------------------------------


def _chi_square(
    counts: Counter[int], probs: list[float], n: int, top: int = 8
) -> tuple[float, int]:
    """Pearson's statistic over the ``top`` likeliest tokens plus one bin for the rest."""
    order = sorted(range(len(probs)), key=lambda t: -probs[t])[:top]
    bins = [(counts[t], probs[t]) for t in order]
    rest_p = 1.0 - sum(p for _, p in bins)
    bins.append((n - sum(c for c, _ in bins), rest_p))
    stat = sum((c - n * p) ** 2 / (n * p) for c, p in bins if p > 0)
    return stat, len(bins) - 1


# Chi-square critical values at p = 1e-4 by degrees of freedom (scipy.stats.chi2.ppf).
CRITICAL = {8: 31.83}


def test_sampled_tokens_have_the_target_distribution(tiny: Any) -> None:
    """Drafting the likeliest token at each position, the first emitted token must follow
    the target's distribution, and the second (after an accepted first) its distribution
    given the first. Fixed seed and sample count: the result is deterministic."""
    model, tok = tiny
    temp = 0.4
    prompt = _prompt(tok, "Hello world")
    cache = make_prompt_cache(model)
    model(mx.array(prompt[:-1])[None], cache=cache)
    last = prompt[-1]
    p1 = mx.softmax(model(mx.array([last])[None], cache=copy.deepcopy(cache))[0, -1] / temp)
    d1 = int(mx.argmax(p1).item())
    c2 = copy.deepcopy(cache)
    model(mx.array([last])[None], cache=c2)
    p2 = mx.softmax(model(mx.array([d1])[None], cache=c2)[0, -1] / temp)
    d2 = int(mx.argmax(p2).item())
    sampler = make_sampler(SamplingParams(temperature=temp, seed=1234))
    firsts: Counter[int] = Counter()
    seconds: Counter[int] = Counter()
    n = 1500
    for _ in range(n):
        out = verify(model, copy.deepcopy(cache), last, [d1, d2], sampler=sampler)
        firsts[out.tokens[0]] += 1
        if out.tokens[0] == d1:
            seconds[out.tokens[1]] += 1
    p1l, p2l = p1.tolist(), p2.tolist()
    stat1, dof = _chi_square(firsts, p1l, n)  # type: ignore[arg-type]
    assert stat1 < CRITICAL[dof], (stat1, firsts.most_common(5))
    m = sum(seconds.values())
    assert m > 100
    stat2, dof = _chi_square(seconds, p2l, m)  # type: ignore[arg-type]
    assert stat2 < CRITICAL[dof], (stat2, seconds.most_common(5))
    # And the check can fail: always accepting the draft is far off.
    wrong: Counter[int] = Counter({d1: n})
    assert _chi_square(wrong, p1l, n)[0] > CRITICAL[8]  # type: ignore[arg-type]
    assert math.isclose(sum(p1l), 1.0, rel_tol=1e-4)  # type: ignore[arg-type]


# ---- the demo model, float32 -----------------------------------------------------------

PROMPTS = [
    "Repeat this list exactly: alpha, beta, gamma, delta, epsilon, zeta, eta, theta.",
    "Write a Python function that returns the sum of squares of a list, then explain it.",
    "Tell me a short story about a lighthouse keeper.",
]


@pytest.fixture(scope="module")
def demo(demo_f32_dir: Path) -> tuple[Any, Any]:
    return load(str(demo_f32_dir))


@pytest.mark.timeout(600)  # demo-model generations: 1-2 minutes alone on 2 cores
@pytest.mark.demo
@pytest.mark.parametrize("drafter", ["lookup", "draft_model"])
def test_demo_model_greedy_output_is_identical(demo: Any, drafter: str) -> None:
    model, tok = demo
    for text in PROMPTS:
        prompt = _prompt(tok, text)
        want = _plain(model, prompt, 32, lambda x: mx.argmax(x, axis=-1))
        d = PromptLookup() if drafter == "lookup" else DraftModel(model)
        got, _ = _speculate(model, prompt, 32, d, k=5)
        assert got == want, text


# ---- flags -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--draft-kind", "dflash"], "not built"),
        (["--draft-kind", "medusa"], "unknown kind"),
        (["--draft-kind", "model"], "needs --draft-model"),
        (["--draft-kind", "ngram", "--draft-model", "x"], "does not use --draft-model"),
    ],
)
def test_draft_kind_flags_that_cannot_work_are_refused_at_start(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from mlx_server.cli import parse_settings

    with pytest.raises(SystemExit) as e:
        parse_settings(["-m", "some-model", *argv], environ={})
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_speculation_flags_parse() -> None:
    from mlx_server.cli import parse_settings

    s = parse_settings(
        ["-m", "m", "--prompt-lookup", "--num-draft-tokens", "6", "--draft-kind", "ngram"],
        environ={},
    )
    assert (s.prompt_lookup, s.num_draft_tokens, s.draft_kind) == (True, 6, "ngram")
    s = parse_settings(["-m", "m", "--draft-model", "d", "--draft-block-size", "16"], environ={})
    assert (s.draft_model, s.draft_block_size, s.prompt_lookup) == ("d", 16, False)


def test_the_server_refuses_a_draft_model_with_another_tokenizer_at_start(
    tiny: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from types import SimpleNamespace

    from mlx_server.boot.chat import _speculation
    from mlx_server.config import Settings
    from mlx_server.models.base import ModelLoadError

    model, tok = tiny
    other = build_tiny_model(tmp_path_factory.mktemp("spec") / "fim2", specials=FIM_SPECIALS)
    loaded = SimpleNamespace(tokenizer=tok)
    with pytest.raises(ModelLoadError, match="tokenizer differs"):
        _speculation(loaded, Settings(model="m", draft_model=str(other)), model)
    same = build_tiny_model(tmp_path_factory.mktemp("spec") / "same")
    _, same_tok = load(str(same))
    spec = _speculation(
        SimpleNamespace(tokenizer=same_tok), Settings(model="m", draft_model=str(same)), model
    )
    assert spec is not None and spec.draft_model is not None
