"""Speculative decoding over HTTP: a real server process on the tiny model, driven by the
official OpenAI SDK in strict mode. Predicted Outputs report their accepted and rejected
tokens in ``usage.completion_tokens_details``; concurrent requests with and without a
prediction (so speculating and plain rows in one batch), streamed and not, give the text
they give one at a time; /metrics counts the drafts."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from clients import openai_client
from engine_runner import build_varied_model
from support import serving
from test_metrics import scrape, value


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = build_varied_model(tmp_path_factory.mktemp("spec-http") / "tiny-varied")
    with serving(["-m", str(model), "--max-batch-size", "4"]) as sp:
        sp.bias = word_bias(model)  # type: ignore[attr-defined]
        yield sp


def word_bias(model_dir: Any) -> dict[str, int]:
    """A logit bias that makes the random model speak in whole words (" the", " fox"): its
    text then tokenizes back to the tokens it chose, so a prediction taken from an answer
    matches it token for token (the random model's free output has bytes that do not)."""
    from mlx_lm import load

    _, tok = load(str(model_dir))[:2]
    words = sorted(i for t, i in tok.vocab.items() if t[:1] == "Ġ" and t[1:].isalpha())
    whole = [i for i in words if tok.encode(tok.decode([i]), add_special_tokens=False) == [i]]
    assert len(whole) >= 8
    return {str(i): 100 for i in whole[:24]}


QUESTIONS = ["the quick brown fox", "hello world", "def add(a, b):", "Paris is the capital"]


def ask(
    c: openai.OpenAI, srv: Any, text: str, *, stream: bool, prediction: str | None = None
) -> Any:
    """(content, usage) of a greedy 40-token answer in whole words."""
    kw: dict[str, Any] = dict(
        model="m",
        messages=[{"role": "user", "content": text}],
        max_tokens=40,
        temperature=0,
        logit_bias=srv.bias,
        extra_body={"ignore_eos": True},
    )
    if prediction is not None:
        kw["prediction"] = {"type": "content", "content": prediction}
    if not stream:
        r = c.chat.completions.create(**kw)
        return r.choices[0].message.content, r.usage
    content, usage = "", None
    for chunk in c.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            content += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    return content, usage


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_prediction_reports_accepted_and_rejected_tokens(server: Any, stream: bool) -> None:
    """Alone, the first drafting step comes right after the two plain steps that time the
    model, whatever they measure: its draft (the prediction's next four words, which the
    answer says) is accepted."""
    c = openai_client(server)
    before = scrape(server.base_url)
    plain, usage = ask(c, server, QUESTIONS[0], stream=stream)
    assert usage.completion_tokens_details is None or (
        usage.completion_tokens_details.accepted_prediction_tokens in (None, 0)
    )
    words = plain.split(" ")
    edited = " ".join(words[:5] + ["lazy lazy"] + words[6:])  # wrong in one place
    got, usage = ask(c, server, QUESTIONS[0], stream=stream, prediction=edited)
    assert got == plain
    details = usage.completion_tokens_details
    assert details is not None
    assert details.accepted_prediction_tokens > 0
    assert details.rejected_prediction_tokens > 0  # the edit, at least
    wrong, usage = ask(c, server, QUESTIONS[0], stream=stream, prediction="nothing like it " * 4)
    assert wrong == plain
    assert usage.completion_tokens_details.rejected_prediction_tokens > 0
    after = scrape(server.base_url)
    drafted, accepted = (
        value(after, name) - value(before, name)
        for name in ("mlx_server_draft_tokens_total", "mlx_server_draft_accepted_tokens_total")
    )
    assert drafted >= accepted >= details.accepted_prediction_tokens > 0
    assert 0 < value(after, "mlx_server_draft_acceptance_rate") <= 1


@pytest.mark.timeout(420)  # concurrent generations given up to 300 s
def test_concurrent_requests_with_and_without_predictions_give_their_own_text(
    server: Any,
) -> None:
    """Speculating and plain rows in one batch, streamed and whole. How much the batch
    drafts depends on the step costs it measures (on a busy CPU it may not pay): the text
    must not, and each prediction is reported."""
    c = openai_client(server)
    alone = [ask(c, server, q, stream=False)[0] for q in QUESTIONS]
    preds = [alone[0], None, alone[2][: len(alone[2]) // 2], None]  # rows 0 and 2 speculate
    with ThreadPoolExecutor(8) as pool:
        jobs = [
            pool.submit(ask, c, server, q, stream=s, prediction=p)
            for s in (False, True)
            for q, p in zip(QUESTIONS, preds, strict=True)
        ]
        results = [j.result(timeout=300) for j in jobs]
    assert [text for text, _ in results] == alone + alone
    for (_, usage), p in zip(results, preds + preds, strict=True):
        details = usage.completion_tokens_details
        if p is None:
            assert details is None or details.accepted_prediction_tokens in (None, 0)
        else:
            assert details is not None
            assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0
