"""The runner interface: the lone-request runner takes the requests people send (penalties,
``ignore_eos``, logprobs, seeded sampling, grammars) and gives the batch's output, keeps it
when a second request moves it into the batch, and a new runner plugs into the engine."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import mlx.core as mx
import pytest
from engine_runner import collect, drive, generate, load_varied_model, request, running_engine, solo

from mlx_server.engine.core.engine import Engine, EngineConfig
from mlx_server.engine.core.handle import Started, TokenPiece
from mlx_server.engine.grammar.constraints import ConstraintCompiler, ConstraintSpec
from mlx_server.engine.grammar.processor import GrammarLogitsProcessor
from mlx_server.engine.runners import solo as solo_runner
from mlx_server.engine.runners.base import Insert, KVState, Progress, Response
from mlx_server.types import SamplingParams

WORDS = "the quick brown fox jumps over lazy dog hello world paris capital of france".split()
PENALTIES = SamplingParams(
    temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4
)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, frequency_penalty=0.3)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    model, tokenizer, _ = load_varied_model(tmp_path_factory)
    return model, tokenizer


@pytest.fixture(scope="module")
def compiler(lm):
    return ConstraintCompiler(lm[1])


def prompt(tokenizer: Any, n_words: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return list(tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(n_words))))


def variants(compiler: ConstraintCompiler) -> dict[str, Any]:
    """Request settings that used to leave the lone path (each call: fresh processors)."""
    return {
        "penalties": lambda: {"sampling": PENALTIES},
        "ignore_eos_logprobs": lambda: {"ignore_eos": True, "logprobs": True, "top_logprobs": 3},
        "seeded": lambda: {"sampling": SEEDED, "ignore_eos": True},
        "grammar": lambda: {
            "logits_processors": (compiler.processor(ConstraintSpec.json_object()),),
            "sampling": SamplingParams(temperature=1.0, seed=3),
        },
        # a grammar stepped on its own, the penalties still called with the context
        "grammar_penalties": lambda: {
            "logits_processors": (compiler.processor(ConstraintSpec.json_object()),),
            "sampling": SamplingParams(temperature=1.0, seed=5, frequency_penalty=1.5),
        },
    }


def same(a: Any, b: Any) -> None:
    assert (a.text, a.reason) == (b.text, b.reason)
    assert a.finished.usage.completion_tokens == b.finished.usage.completion_tokens
    assert [e.token for e in a.logprobs] == [e.token for e in b.logprobs]
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
        assert [t.token for t in x.top] == [t.token for t in y.top]


@pytest.fixture(params=["inline", "beside"])
def fills(request, monkeypatch):
    """A lone stream's grammar read and filled on the engine's thread after the launch
    (a machine without cores to spare), or on the masks' worker during it (one with)."""
    monkeypatch.setattr(
        solo_runner, "default_threads", lambda: 1 if request.param == "inline" else 4
    )
    return request.param


def test_the_lone_runner_takes_requests_with_processors_and_matches_the_batch(lm, compiler, fills):
    model, tokenizer = lm
    p = prompt(tokenizer, 12, seed=1)
    cfg = {"prompt_cache_size": 0, "max_batch_size": 4}
    with (
        running_engine(model, tokenizer, **cfg) as lone,
        running_engine(model, tokenizer, solo=False, **cfg) as batch,
    ):
        for name, settings in variants(compiler).items():
            before = lone.stats()
            (fast,) = solo(lone, [request(p, 24, **settings())])
            after = lone.stats()
            assert after["solo_runs"] == before["solo_runs"] + 1, name
            # after its first token a grammar is masked a step at a time, not called (the
            # step queued after the last token too)
            masked = after["solo_grammar_steps"] - before["solo_grammar_steps"]
            beside = after["solo_grammar_fills_beside"] - before["solo_grammar_fills_beside"]
            tokens = fast.finished.usage.completion_tokens
            assert masked == (tokens if name.startswith("grammar") else 0), name
            assert beside == (masked if fills == "beside" else 0), name
            (slow,) = solo(batch, [request(p, 24, **settings())])
            same(fast, slow)
            if name == "ignore_eos_logprobs":
                assert fast.reason == "length" and len(fast.logprobs) == 24
        assert "solo_runs" not in batch.stats()


def test_a_lone_stream_with_processors_keeps_its_output_when_others_join(lm, compiler, fills):
    """The handed-over sequence takes its sampler, processors and their token context to
    the batch: its text is what it gives alone, at every point of joining."""
    model, tokenizer = lm
    lead_prompt = prompt(tokenizer, 40, seed=2)
    others = [prompt(tokenizer, 6 + 4 * i, seed=10 + i) for i in range(2)]
    with running_engine(
        model, tokenizer, prompt_cache_size=0, prefill_step_size=16, max_batch_size=4
    ) as engine:
        for name, settings in variants(compiler).items():
            (alone,) = solo(engine, [request(lead_prompt, 30, **settings())])
            rest = solo(engine, [request(p, 8) for p in others])

            async def join(after: int, settings: Any = settings) -> tuple[Any, str, list[Any]]:
                lead = engine.submit(request(lead_prompt, 30, **settings()))
                text, seen, joined = "", 0, []
                async for ev in lead:
                    if isinstance(ev, TokenPiece):
                        text += ev.text
                        seen += 1
                        if seen == after:
                            joined = [
                                asyncio.ensure_future(collect(engine.submit(request(p, 8))))
                                for p in others
                            ]
                    elif not isinstance(ev, Started):
                        return ev, text, list(await asyncio.gather(*joined))
                raise AssertionError("no Finished")

            for after in (1, 6):
                runs = engine.stats()["solo_runs"]
                fin, text, joined = drive(engine, join(after))
                assert engine.stats()["solo_runs"] == runs + 1, name
                assert (text, fin.reason) == (alone.text, alone.reason), (name, after)
                assert fin.usage.completion_tokens == alone.finished.usage.completion_tokens
                assert [r.text for r in joined] == [r.text for r in rest], name


class Exploding(GrammarLogitsProcessor):
    """A grammar whose step fails after a few tokens (as a bug in it would)."""

    def observe(self, token: int) -> int | None:
        if self.consumed >= 3:
            raise RuntimeError("grammar exploded")
        return super().observe(token)


def test_a_grammar_failing_on_the_lone_path_ends_only_its_own_request(lm, compiler, fills):
    """A stepped grammar that raises ends its request with the error; the engine serves
    the next request, alone, as before."""
    model, tokenizer = lm
    p = prompt(tokenizer, 12, seed=4)
    spec = ConstraintSpec.json_object()
    base = compiler.processor(spec)
    with running_engine(model, tokenizer, prompt_cache_size=0, max_batch_size=4) as engine:
        exploding = Exploding(
            compiler.compile(spec).deep_copy(), mask_vocab=len(tokenizer), eos_ids=base.eos_ids
        )
        sampling = SamplingParams(temperature=1.0, seed=1)
        (failed,) = solo(
            engine, [request(p, 40, sampling=sampling, logits_processors=(exploding,))]
        )
        assert failed.reason == "error" and "grammar exploded" in (failed.finished.error or "")
        assert engine.stats()["solo_grammar_steps"] >= 1  # it failed while stepped
        (after,) = solo(engine, [request(p, 12, ignore_eos=True)])
        assert after.reason == "length" and after.finished.usage.completion_tokens == 12
        assert engine.stats()["solo_runs"] == 2


class ListRunner:
    """A runner that 'generates' a fixed list of token ids: the smallest plug-in."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens
        self.running: dict[int, int] = {}  # uid -> tokens emitted
        self.max_tokens: dict[int, int] = {}
        self.removed: list[int] = []

    def insert(self, job: Insert) -> None:
        self.running[job.uid] = 0
        self.max_tokens[job.uid] = job.request.max_tokens

    def step(self) -> tuple[list[Progress], list[Response]]:
        out = []
        for uid, n in list(self.running.items()):
            self.running[uid] = n + 1
            done = n + 1 >= min(len(self.tokens), self.max_tokens[uid])
            if done:
                del self.running[uid]
            logprobs = mx.zeros((4,))
            out.append(Response(uid, self.tokens[n], logprobs, "length" if done else None))
        return [], out

    def remove(self, uids: list[int]) -> dict[int, KVState]:
        for uid in uids:
            if self.running.pop(uid, None) is not None:
                self.removed.append(uid)
        return {}

    def extract_state(self, uids: list[int]) -> dict[int, KVState]:
        return {}

    def reset(self) -> None:
        self.running.clear()

    def close(self) -> None:
        self.running.clear()

    def stats(self) -> dict[str, Any]:
        return {"list_runner_running": len(self.running)}


def test_a_new_runner_plugs_in_and_the_engine_delivers_its_tokens(lm):
    """Text, stop strings, usage and stats come from the engine, whatever the runner."""
    model, tokenizer = lm
    tokens = list(tokenizer.encode(" hello world paris capital of france"))
    runner = ListRunner(tokens)
    engine = Engine(model, tokenizer, EngineConfig(prompt_cache_size=0), runner=runner)
    engine.start()
    try:
        whole = drive(engine, generate(engine, request([1, 2, 3], 100)))
        assert whole.text.strip() == tokenizer.decode(tokens).strip() and whole.reason == "length"
        assert whole.finished.usage.completion_tokens == len(tokens)
        stopped = drive(engine, generate(engine, request([1, 2, 3], 100, stop=("paris",))))
        assert stopped.reason == "stop_sequence" and "paris" not in stopped.text
        assert stopped.text == whole.text[: whole.text.index("paris")]
        assert len(runner.removed) == 1  # the stop string took it out of the runner
        assert engine.stats()["list_runner_running"] == 0
    finally:
        engine.shutdown(timeout=10)


class ShapeSpy:
    """The model, recording the length of every input it is given."""

    def __init__(self, model: Any):
        self.model = model
        self.lengths: list[int] = []

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        self.lengths.append(int(inputs.shape[1]))
        return self.model(inputs, cache=cache)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def test_bucketed_prefill_chunks_give_the_same_output(lm):
    """Where kernels are built per shape, the lone path pads prefill chunks to a few bucket
    lengths and drops the padding from the cache: the output is the unpadded one's, also
    after a prefix-cache hit."""
    model, tokenizer = lm
    cfg = {"prefill_step_size": 64, "max_batch_size": 2}
    spy = ShapeSpy(model)
    with (
        running_engine(spy, tokenizer, prefill_buckets=True, **cfg) as padded,
        running_engine(model, tokenizer, **cfg) as plain,
    ):
        for i, settings in enumerate(({}, {"logprobs": True, "top_logprobs": 3})):
            history = prompt(tokenizer, 30, seed=4 + i)
            turns = [history, history + prompt(tokenizer, 7, seed=6 + i)]  # then a warm turn
            spy.lengths.clear()
            got = solo(padded, [request(t, 12, ignore_eos=True, **settings) for t in turns])
            want = solo(plain, [request(t, 12, ignore_eos=True, **settings) for t in turns])
            for a, b in zip(got, want, strict=True):
                same(a, b)
            assert got[1].cached > 0  # the warm turn was served from the prefix cache
            chunks = [n for n in spy.lengths if n > 1]
            # every short chunk (30 tokens, then 7) meets the one length (``PREFILL_BUCKETS``)
            assert chunks and set(chunks) == {64}, spy.lengths
