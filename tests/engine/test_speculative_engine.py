"""Speculative decoding in the engine: the same output as without it, whatever the request
brings (penalties, seeds, grammars, logprobs, stop strings, a prediction), alone or mixed
into a batch, cancelled mid-way; and its counts in timings and usage."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from engine_runner import (
    collect,
    drive,
    generate_all,
    load_varied_model,
    request,
    running_engine,
    solo,
)

from mlx_server.engine.core.handle import TokenPiece
from mlx_server.engine.grammar.constraints import ConstraintCompiler, ConstraintSpec
from mlx_server.engine.speculative.runner import Speculation
from mlx_server.events import Finished
from mlx_server.types import SamplingParams

CFG = {"prompt_cache_size": 0, "max_batch_size": 4}


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    model, tokenizer, _ = load_varied_model(tmp_path_factory)
    return model, tokenizer


def repetitive(tokenizer: Any) -> list[int]:
    """A prompt whose text repeats, so prompt lookup has something to draft."""
    return list(tokenizer.encode("the quick brown fox jumps over the lazy dog. " * 6))


def variants(compiler: ConstraintCompiler) -> dict[str, Any]:
    return {
        "greedy": lambda: {"ignore_eos": True},
        "penalties": lambda: {
            "sampling": SamplingParams(temperature=0.0, repetition_penalty=1.2),
            "ignore_eos": True,
        },
        "seeded": lambda: {
            "sampling": SamplingParams(temperature=0.8, top_p=0.9, seed=5),
            "ignore_eos": True,
        },
        "logprobs": lambda: {"logprobs": True, "top_logprobs": 3, "ignore_eos": True},
        "grammar": lambda: {
            "logits_processors": (compiler.processor(ConstraintSpec.json_object()),),
        },
        "stop": lambda: {"stop": ("fox", "dog."), "ignore_eos": True},
    }


def same(a: Any, b: Any, name: str) -> None:
    assert (a.text, a.reason) == (b.text, b.reason), name
    assert a.finished.usage.completion_tokens == b.finished.usage.completion_tokens, name
    assert [e.token for e in a.logprobs] == [e.token for e in b.logprobs], name
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


@pytest.mark.parametrize(
    "spec",
    [
        Speculation(num_draft_tokens=4, prompt_lookup=True),
        # each pass queued behind the one read, as on a GPU (sequence.py)
        Speculation(num_draft_tokens=4, prompt_lookup=True, pipelined=True),
        Speculation(num_draft_tokens=3, draft_model="self"),
    ],
    ids=["prompt_lookup", "prompt_lookup_queued", "draft_model"],
)
def test_speculating_alone_gives_the_output_of_plain_decoding(lm: Any, spec: Speculation) -> None:
    model, tokenizer = lm
    if spec.draft_model == "self":
        spec = Speculation(spec.num_draft_tokens, draft_model=model)
    compiler = ConstraintCompiler(tokenizer)
    p = repetitive(tokenizer)
    with (
        running_engine(model, tokenizer, speculation=spec, **CFG) as fast,
        running_engine(model, tokenizer, **CFG) as plain,
    ):
        drafted = 0
        for name, settings in variants(compiler).items():
            (got,) = solo(fast, [request(p, 40, **settings())])
            (want,) = solo(plain, [request(p, 40, **settings())])
            same(got, want, name)
            t = got.finished.timings
            assert t is not None and 0 <= t.draft_n_accepted <= t.draft_n
            drafted += t.draft_n
            if spec.draft_model is not None and name == "greedy":
                assert t.draft_n_accepted == t.draft_n > 0  # the model drafting for itself
        assert drafted > 0
        assert fast.stats()["draft_tokens"] == drafted


def test_a_prediction_is_drafted_and_counted_in_usage(lm: Any) -> None:
    model, tokenizer = lm
    p = repetitive(tokenizer)[:20]
    spec = Speculation(adaptive=False)  # drafts every step: the counts do not hang on timing
    with running_engine(model, tokenizer, speculation=spec, **CFG) as engine:
        (plain,) = solo(engine, [request(p, 30, ignore_eos=True)])
        ids = list(tokenizer.encode(plain.text))
        edited = ids[:8] + ids[10:]  # the prediction misses two tokens
        (got,) = solo(engine, [request(p, 30, ignore_eos=True, prediction_tokens=tuple(edited))])
    assert (got.text, got.reason) == (plain.text, plain.reason)
    usage = got.finished.usage
    assert usage.accepted_prediction_tokens is not None and usage.accepted_prediction_tokens > 8
    assert usage.accepted_prediction_tokens + usage.rejected_prediction_tokens == len(edited)
    assert plain.finished.usage.accepted_prediction_tokens is None


@pytest.mark.parametrize("queued", [None, True], ids=["default", "queued"])
def test_a_batch_mixes_speculating_and_plain_requests_with_unchanged_output(
    lm: Any, queued: bool | None
) -> None:
    """The first request starts alone and speculates; three more join it in the batch
    (``queued``: a pass may be queued ahead when they come, dropped before the handover)."""
    model, tokenizer = lm
    p = repetitive(tokenizer)
    others = [list(tokenizer.encode(f"hello world {i} paris")) for i in range(3)]
    spec = Speculation(prompt_lookup=True, pipelined=queued)
    with (
        running_engine(model, tokenizer, speculation=spec, **CFG) as fast,
        running_engine(model, tokenizer, **CFG) as plain,
    ):

        async def mixed(engine: Any) -> list[Any]:
            lead = engine.submit(request(p, 40, ignore_eos=True))
            first = asyncio.ensure_future(collect(lead))
            await asyncio.sleep(0)  # the lead is queued first
            rest = await generate_all(engine, [request(o, 16, ignore_eos=True) for o in others])
            return [await first, *rest]

        got = drive(fast, mixed(fast))
        want = solo(plain, [request(p, 40, ignore_eos=True)]) + solo(
            plain, [request(o, 16, ignore_eos=True) for o in others]
        )
    for g, w in zip(got, want, strict=True):
        same(g, w, "batch")


def test_cancelling_mid_speculation_frees_the_sequence_and_the_next_request_is_exact(
    lm: Any,
) -> None:
    model, tokenizer = lm
    p = repetitive(tokenizer)
    spec = Speculation(prompt_lookup=True, pipelined=True)  # a pass may be queued ahead
    with running_engine(model, tokenizer, speculation=spec, **CFG) as e:
        (want,) = solo(e, [request(p, 40, ignore_eos=True)])

        async def cancel_after(n: int) -> Any:
            handle = e.submit(request(p, 400, ignore_eos=True))
            pieces = 0
            async for ev in handle:
                if isinstance(ev, TokenPiece):
                    pieces += 1
                    if pieces == n:
                        handle.cancel()
                elif isinstance(ev, Finished):
                    return ev
            raise AssertionError("no Finished")

        fin = drive(e, cancel_after(3))
        assert fin.reason == "cancelled"
        (again,) = solo(e, [request(p, 40, ignore_eos=True)])
        assert e.active_count == 0
    same(again, want, "after cancel")


def test_predicted_outputs_on_the_wire() -> None:
    """The request field parses in both of OpenAI's shapes and the usage it yields is what
    the official SDK reads."""
    from openai.types.completion_usage import CompletionUsage

    from mlx_server.events import Usage
    from mlx_server.protocols.openai.chat.schemas import ChatCompletionRequest
    from mlx_server.protocols.openai.finish import usage_json

    msgs = [{"role": "user", "content": "edit this"}]
    parts = [{"type": "text", "text": "def f():"}, {"type": "text", "text": " pass"}]
    for content in ("def f(): pass", parts):
        body = ChatCompletionRequest(
            messages=msgs, prediction={"type": "content", "content": content}
        )
        assert body.prediction is not None and body.prediction.text == "def f(): pass"
    with pytest.raises(ValueError):
        ChatCompletionRequest(messages=msgs, prediction={"type": "file", "content": "x"})
    usage = CompletionUsage.model_validate(usage_json(Usage(5, 7, 0, 6, 2)))
    details = usage.completion_tokens_details
    assert details is not None
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (6, 2)
    assert "completion_tokens_details" not in usage_json(Usage(5, 7))
