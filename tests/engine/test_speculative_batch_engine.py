"""Speculation inside the engine's batch: requests that speculate (a prediction, prompt
lookup) and requests that do not, started together, give the output of the engine without
speculation, whatever they bring (penalties, seeds, grammars, logprobs, stop strings,
limits that fall inside a draft); cancelling one mid-way leaves the others exact."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from conftest_gguf import (  # noqa: F401  (fixtures)
    demo_f32_dir_fixture,
    demo_gguf_fixture,
)
from engine_runner import collect, drive, generate_all, load_varied_model, request, running_engine

from mlx_server.engine.core.handle import TokenPiece
from mlx_server.engine.grammar.constraints import ConstraintCompiler, ConstraintSpec
from mlx_server.engine.speculative.runner import Speculation
from mlx_server.events import Finished
from mlx_server.types import SamplingParams

CFG = {"prompt_cache_size": 0, "max_batch_size": 4}
ALWAYS = Speculation(num_draft_tokens=4, adaptive=False)  # every step drafts: the worst case


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    model, tokenizer, _ = load_varied_model(tmp_path_factory)
    return model, tokenizer


def prompts(tokenizer: Any) -> list[list[int]]:
    texts = ["the quick brown fox jumps over the lazy dog. " * 3, "hello world paris", "1 2 3"]
    return [list(tokenizer.encode(t)) for t in [*texts, "def add(a, b): return a + b"]]


def same(a: Any, b: Any, name: str) -> None:
    assert (a.text, a.reason) == (b.text, b.reason), name
    assert a.finished.usage.completion_tokens == b.finished.usage.completion_tokens, name
    assert [e.token for e in a.logprobs] == [e.token for e in b.logprobs], name
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4), name


def batch(engine: Any, reqs: list[Any]) -> list[Any]:
    return drive(engine, generate_all(engine, reqs))


def predicted(tokenizer: Any, results: list[Any], which: list[int]) -> list[tuple[int, ...]]:
    """The earlier answers as predictions for the rows in ``which`` (others: none), one
    token changed so that drafts are rejected there."""
    out: list[tuple[int, ...]] = []
    for i, r in enumerate(results):
        ids = list(tokenizer.encode(r.text))
        if i in which and len(ids) > 6:
            ids[5] = (ids[5] + 1) % 300
        out.append(tuple(ids) if i in which else ())
    return out


SETTINGS = {
    "greedy": lambda c: {"ignore_eos": True},
    "penalties": lambda c: {
        "sampling": SamplingParams(temperature=0.0, repetition_penalty=1.2),
        "ignore_eos": True,
    },
    "seeded": lambda c: {
        "sampling": SamplingParams(temperature=0.8, top_p=0.9, seed=5),
        "ignore_eos": True,
    },
    "logprobs": lambda c: {"logprobs": True, "top_logprobs": 3, "ignore_eos": True},
    "grammar": lambda c: {"logits_processors": (c.processor(ConstraintSpec.json_object()),)},
    "stop": lambda c: {"ignore_eos": True},  # the stop strings: from the free output
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_batch_of_speculating_and_plain_requests_gives_unchanged_output(
    lm: Any, name: str
) -> None:
    """Rows 0 and 2 carry a prediction, rows 1 and 3 do not; max_tokens fall inside drafts."""
    model, tokenizer = lm
    compiler = ConstraintCompiler(tokenizer)
    ps, limits = prompts(tokenizer), [37, 30, 23, 30]

    def reqs(preds: list[tuple[int, ...]] | None = None, **kw: Any) -> list[Any]:
        preds = preds or [()] * 4
        return [
            request(p, n, prediction_tokens=pr, **SETTINGS[name](compiler), **kw)
            for p, n, pr in zip(ps, limits, preds, strict=True)
        ]

    with (
        running_engine(model, tokenizer, speculation=ALWAYS, **CFG) as fast,
        running_engine(model, tokenizer, **CFG) as plain,
    ):
        free = batch(plain, reqs())
        kw: dict[str, Any] = {}
        if name == "stop":  # strings the rows would say mid-way, inside some draft
            kw["stop"] = (free[0].text[30:33], free[2].text[25:28])
            assert all(x.strip() for x in kw["stop"])
        want = batch(plain, reqs(**kw)) if kw else free
        got = batch(fast, reqs(predicted(tokenizer, free, [0, 2]), **kw))
        assert fast.stats()["solo_runs"] == 0  # they ran in the batch, not alone
    if name == "stop":
        assert sum(w.reason == "stop_sequence" for w in want) >= 2
    for g, w in zip(got, want, strict=True):
        same(g, w, name)
    drafted = [g.finished.timings.draft_n if g.finished.timings else 0 for g in got]
    accepted = [g.finished.timings.draft_n_accepted if g.finished.timings else 0 for g in got]
    assert drafted[1] == drafted[3] == 0
    if name != "grammar":  # a grammar's output is not the random model's free text
        assert accepted[0] > 0 and accepted[2] > 0
        assert got[0].finished.usage.accepted_prediction_tokens == accepted[0]


def test_prompt_lookup_in_a_batch_gives_unchanged_output(lm: Any) -> None:
    model, tokenizer = lm
    ps = prompts(tokenizer)
    reqs = lambda: [request(p, 40, ignore_eos=True) for p in ps]  # noqa: E731
    spec = Speculation(num_draft_tokens=3, prompt_lookup=True, adaptive=False)
    with (
        running_engine(model, tokenizer, speculation=spec, **CFG) as fast,
        running_engine(model, tokenizer, **CFG) as plain,
    ):
        want = batch(plain, reqs())
        got = batch(fast, reqs())
        assert fast.stats()["draft_tokens"] > 0
    for g, w in zip(got, want, strict=True):
        same(g, w, "lookup")


def test_a_draft_model_drafts_for_every_row_of_a_batch(lm: Any) -> None:
    """The model drafting for itself, each row with its own draft cache: the rows keep
    their output and accept every draft."""
    model, tokenizer = lm
    ps = prompts(tokenizer)
    spec = Speculation(num_draft_tokens=3, draft_model=model, adaptive=False)
    with (
        running_engine(model, tokenizer, speculation=spec, **CFG) as fast,
        running_engine(model, tokenizer, **CFG) as plain,
    ):
        want = batch(plain, [request(p, 30, ignore_eos=True) for p in ps])
        got = batch(fast, [request(p, 30, ignore_eos=True) for p in ps])
    for g, w in zip(got, want, strict=True):
        same(g, w, "draft model")
        t = g.finished.timings
        assert t is not None and t.draft_n_accepted == t.draft_n > 0


def test_a_lone_speculating_request_goes_on_speculating_in_the_batch(lm: Any) -> None:
    """The first request starts alone and speculates; three more join it in the batch; it
    keeps its drafter there."""
    model, tokenizer = lm
    ps = prompts(tokenizer)
    with (
        running_engine(model, tokenizer, speculation=ALWAYS, **CFG) as fast,
        running_engine(model, tokenizer, **CFG) as plain,
    ):
        (lead_want,) = batch(plain, [request(ps[0], 60, ignore_eos=True)])
        pred = tuple(tokenizer.encode(lead_want.text))
        rest_want = batch(plain, [request(p, 20, ignore_eos=True) for p in ps[1:]])

        async def mixed() -> list[Any]:
            lead = fast.submit(request(ps[0], 60, ignore_eos=True, prediction_tokens=pred))
            started = asyncio.Event()
            first = asyncio.ensure_future(collect_noting_first(lead, started))
            await asyncio.wait_for(started.wait(), 60)  # it runs alone now
            rest = await generate_all(fast, [request(p, 20, ignore_eos=True) for p in ps[1:]])
            return [await first, *rest]

        got = drive(fast, mixed())
        assert fast.stats()["solo_runs"] == 1
    for g, w in zip(got, [lead_want, *rest_want], strict=True):
        same(g, w, "handover")
    t = got[0].finished.timings
    assert t is not None and t.draft_n_accepted > 20  # in the batch as well as alone


async def collect_noting_first(handle: Any, started: asyncio.Event) -> Any:
    """``collect``, setting ``started`` at the first generated text."""
    from engine_runner import Result

    text, logprobs = "", []
    async for ev in handle:
        if isinstance(ev, TokenPiece):
            text += ev.text
            logprobs.extend(ev.logprobs)
            started.set()
        elif isinstance(ev, Finished):
            return Result(text, ev, logprobs)
    raise AssertionError("the stream ended without Finished")


def test_cancelling_a_speculating_row_leaves_the_others_exact(lm: Any) -> None:
    model, tokenizer = lm
    ps = prompts(tokenizer)
    with (
        running_engine(model, tokenizer, speculation=ALWAYS, **CFG) as fast,
        running_engine(model, tokenizer, **CFG) as plain,
    ):
        want = batch(plain, [request(p, 40, ignore_eos=True) for p in ps])
        preds = predicted(tokenizer, want, [0, 1, 2, 3])

        async def cancel_one() -> list[Any]:
            handles = [
                fast.submit(request(p, 40 if i else 400, ignore_eos=True, prediction_tokens=pr))
                for i, (p, pr) in enumerate(zip(ps, preds, strict=True))
            ]

            async def cancelled(h: Any) -> Any:
                pieces = 0
                async for ev in h:
                    if isinstance(ev, TokenPiece):
                        pieces += 1
                        if pieces == 3:
                            h.cancel()
                    elif isinstance(ev, Finished):
                        return ev
                raise AssertionError("no Finished")

            return list(
                await asyncio.gather(cancelled(handles[0]), *(collect(h) for h in handles[1:]))
            )

        fin, *rest = drive(fast, cancel_one())
        assert fin.reason == "cancelled"
        again = batch(fast, [request(p, 40, ignore_eos=True) for p in ps])
        assert fast.active_count == 0
    for g, w in zip(rest, want[1:], strict=True):
        same(g, w, "beside a cancelled row")
    for g, w in zip(again, want, strict=True):
        same(g, w, "after the cancel")


# ---- the demo model, float32 -----------------------------------------------------------

DEMO_PROMPTS = [
    "Repeat this list exactly: alpha, beta, gamma, delta, epsilon, zeta, eta, theta.",
    "Write a Python function that returns the sum of squares of a list.",
    "Tell me a short story about a lighthouse keeper.",
    "Copy this sentence twice: the cat sat on the mat.",
]


@pytest.fixture(scope="module")
def demo(demo_f32_dir: Any) -> tuple[Any, Any]:
    from mlx_lm import load

    return load(str(demo_f32_dir))[:2]


@pytest.mark.timeout(600)  # demo-model generations: 1-2 minutes alone on 2 cores
@pytest.mark.demo
def test_demo_model_greedy_output_is_identical_in_a_batch(demo: Any) -> None:
    """Greedy, float32, four requests together: prompt lookup for all of them, then
    predictions for two (the other two plain), against the batch without drafts. (Alone,
    tests/engine/test_speculative.py compares the lone path with mlx-lm's plain decoding.)"""
    from engine_runner import chat_tokens

    model, tokenizer = demo
    ps = [chat_tokens(tokenizer, [{"role": "user", "content": t}]) for t in DEMO_PROMPTS]
    reqs = lambda preds=None: [  # noqa: E731
        request(p, 32, prediction_tokens=pr) for p, pr in zip(ps, preds or [()] * 4, strict=True)
    ]
    with running_engine(model, tokenizer, **CFG) as plain:
        want = batch(plain, reqs())
    preds = predicted(tokenizer, want, [0, 3])
    lookup = Speculation(num_draft_tokens=4, prompt_lookup=True, adaptive=False)
    with running_engine(model, tokenizer, speculation=ALWAYS, **CFG) as fast:
        mixed = batch(fast, reqs(preds))
    with running_engine(model, tokenizer, speculation=lookup, **CFG) as fast:
        looked_up = batch(fast, reqs())
        assert fast.stats()["draft_tokens"] > 0
    for g, h, w in zip(mixed, looked_up, want, strict=True):
        same(g, w, "batch, predictions")
        same(h, w, "batch, prompt lookup")
    assert mixed[0].finished.usage.accepted_prediction_tokens


def test_grammars_the_batch_masks_are_applied_in_verifying_steps(lm: Any) -> None:
    """Verifying steps alternate with plain ones, so each row's grammar is taken over by
    the batch's grammar masks (out of mlx-lm's per-row list) and then verified per
    position: the JSON is the plain engine's."""
    from mlx_server.engine.speculative.batch import AlwaysDraft

    class EveryOther(AlwaysDraft):
        turn = False

        def worth_trying(self, rows: Any) -> bool:
            self.turn = not self.turn
            return self.turn and super().worth_trying(rows)

    model, tokenizer = lm
    compiler = ConstraintCompiler(tokenizer)
    ps = prompts(tokenizer)

    def reqs(preds: list[tuple[int, ...]]) -> list[Any]:
        return [
            request(p, 40, prediction_tokens=pr, **SETTINGS["grammar"](compiler))
            for p, pr in zip(ps, preds, strict=True)
        ]

    with (
        running_engine(model, tokenizer, speculation=ALWAYS, **CFG) as fast,
        running_engine(model, tokenizer, **CFG) as plain,
    ):
        want = batch(plain, reqs([()] * 4))
        runner = fast._runner.batch  # type: ignore[attr-defined]
        runner.speculator.plan = EveryOther(4)
        got = batch(fast, reqs(predicted(tokenizer, want, [0, 1, 2, 3])))
        assert runner._masks is not None and runner._masks.steps > 0  # the batch masked
    for g, w in zip(got, want, strict=True):
        same(g, w, "grammar, batch masks")
    assert sum(g.finished.timings.draft_n for g in got if g.finished.timings) > 0


def test_the_speculating_lone_path_pads_its_prefill_chunks_too(lm: Any) -> None:
    """With speculation configured (the server's default for a text model) the lone path
    is the speculating runner: it pads prefill chunks to the bucket lengths like the solo
    runner, with or without a drafter, and the output is unchanged."""
    from engine_runner import solo
    from test_runners import ShapeSpy

    model, tokenizer = lm
    spy = ShapeSpy(model)
    cfg = {"prompt_cache_size": 0, "prefill_step_size": 64, "max_batch_size": 2}
    spec = Speculation(num_draft_tokens=3, prompt_lookup=True)
    long = prompts(tokenizer)[0] * 2  # 94 tokens: one chunk of 64, then a padded one
    with (
        running_engine(spy, tokenizer, prefill_buckets=True, speculation=spec, **cfg) as fast,
        running_engine(model, tokenizer, **cfg) as plain,
    ):
        got = solo(fast, [request(long, 12, ignore_eos=True)])
        want = solo(plain, [request(long, 12, ignore_eos=True)])
        assert fast.stats()["solo_runs"] == 1
    same(got[0], want[0], "buckets")
    chunks = [n for n in spy.lengths if n > 8]  # prefill chunks, not verifying steps
    assert chunks and set(chunks) <= {16, 32, 64}, spy.lengths
