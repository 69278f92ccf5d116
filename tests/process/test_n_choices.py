"""``n`` choices on chat and text completions: scripted (the protocol, exactly) and on the
demo model (seeded reproducibility, tools, a schema, logprobs, the batch)."""

from __future__ import annotations

import json

import httpx
import pytest
from clients import openai_client, sse_data
from payloads import closed_object
from support import ServerProcess

USER = [{"role": "user", "content": "Say something."}]


# ---- scripted: the protocol ---------------------------------------------------------------


def test_chat_n_collected(scripted):
    for text in ("one", "two", "three"):
        scripted.engine.push(text)
    out = openai_client(scripted).chat.completions.create(
        model="m", messages=USER, n=3, seed=7, temperature=1
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert sorted(c.message.content for c in out.choices) == ["one", "three", "two"]
    reqs = scripted.engine.requests[-3:]
    assert [r.sampling.seed for r in reqs] == [7, 8, 9]  # seed + i, documented
    assert len({r.request_id for r in reqs}) == 1
    assert len({tuple(r.prompt_tokens) for r in reqs}) == 1
    prompt = len(reqs[0].prompt_tokens)
    assert out.usage.prompt_tokens == prompt  # the prompt counted once
    assert out.usage.completion_tokens == 3  # every choice's tokens


def test_chat_n_streamed(scripted):
    for text in (["a", "b"], ["c"], ["d", "e", "f"]):
        scripted.engine.push(*text)
    body = {"messages": USER, "n": 3, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream(
        "POST", f"{scripted.base_url}/v1/chat/completions", json=body, timeout=30
    ) as r:
        chunks = sse_data(r.iter_lines())
    texts: dict[int, str] = {}
    finished = []
    for c in chunks:
        for ch in c["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + (ch["delta"].get("content") or "")
            if ch["finish_reason"]:
                finished.append(ch["index"])
    assert sorted(texts.values()) == ["ab", "c", "def"]
    assert sorted(finished) == [0, 1, 2]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert all("usage" not in c for c in chunks[:-1])


def test_sdk_stream_with_n(scripted):
    stream = openai_client(scripted).chat.completions.create(
        model="m", messages=USER, n=2, stream=True
    )
    indices = {ch.index for chunk in stream for ch in chunk.choices}
    assert indices == {0, 1}


def test_text_completions_n_per_prompt(scripted):
    for text in ("p0a", "p0b", "p1a", "p1b"):
        scripted.engine.push(text)
    r = httpx.post(
        f"{scripted.base_url}/v1/completions",
        json={"prompt": ["first", "second prompt"], "n": 2, "seed": 1, "max_tokens": 4},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    reqs = scripted.engine.requests[-4:]
    prompts = {tuple(q.prompt_tokens): q for q in reqs}
    assert len(prompts) == 2
    # Prompt p's choice j is index p * n + j; its seed is seed + j.
    assert sorted(q.sampling.seed for q in reqs) == [1, 1, 2, 2]
    assert out["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_n_above_the_bound_is_a_400(scripted, path):
    body = {"n": 17, **({"messages": USER} if "chat" in path else {"prompt": "x"})}
    before = len(scripted.engine.requests)
    r = httpx.post(f"{scripted.base_url}{path}", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert len(scripted.engine.requests) == before


def test_admission_counts_every_choice(scripted_factory):
    from scripted_engine import ScriptedEngine

    srv = scripted_factory(engine=ScriptedEngine(max_queue=2))
    r = httpx.post(
        f"{srv.base_url}/v1/chat/completions", json={"messages": USER, "n": 3}, timeout=30
    )
    assert r.status_code == 503, r.text
    ok = httpx.post(
        f"{srv.base_url}/v1/chat/completions", json={"messages": USER, "n": 2}, timeout=30
    )
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


# ---- the demo model ------------------------------------------------------------------------


@pytest.fixture
def demo(demo_server: ServerProcess) -> ServerProcess:
    return demo_server  # the session's demo-model server (conftest.py)


@pytest.mark.demo
@pytest.mark.timeout(600)  # demo-model generations: up to 3 minutes on a loaded 2-core machine
def test_seeded_n_is_reproducible_and_each_choice_differs(demo):
    def ask():
        return openai_client(demo).chat.completions.create(
            model="m",
            messages=USER,
            n=3,
            seed=42,
            temperature=1.0,
            max_tokens=12,
            logprobs=True,
        )

    a, b = ask(), ask()
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]
    assert len(set(texts)) > 1  # each choice has its own seed stream
    assert all(len(c.logprobs.content) == 12 or c.finish_reason == "stop" for c in a.choices)
    # Choice i is what a single request with seed + i samples.
    solo = openai_client(demo).chat.completions.create(
        model="m", messages=USER, seed=43, temperature=1.0, max_tokens=12
    )
    assert solo.choices[0].message.content == texts[1]


@pytest.mark.demo
def test_streamed_n_matches_collected(demo):
    body = {"messages": USER, "n": 3, "seed": 5, "temperature": 1.0, "max_tokens": 10}
    whole = httpx.post(f"{demo.base_url}/v1/chat/completions", json=body, timeout=120).json()
    with httpx.stream(
        "POST",
        f"{demo.base_url}/v1/chat/completions",
        json={**body, "stream": True},
        timeout=120,
    ) as r:
        chunks = sse_data(r.iter_lines())
    texts = ["", "", ""]
    for c in chunks:
        for ch in c["choices"]:
            texts[ch["index"]] += ch["delta"].get("content") or ""
    assert texts == [c["message"]["content"] for c in whole["choices"]]
    # The same counts; the cached share may differ: the first request's prompt is in the
    # prefix cache for the second, and earlier tests on the same server may have put it
    # there for the first too.
    streamed, collected = dict(chunks[-1]["usage"]), dict(whole["usage"])
    for u in (streamed, collected):
        assert 0 <= u.pop("prompt_tokens_details")["cached_tokens"] < u["prompt_tokens"]
    assert streamed == collected


@pytest.mark.demo
@pytest.mark.timeout(600)  # demo-model generations: up to 3 minutes on a loaded 2-core machine
def test_n_with_a_schema_and_with_tools(demo):
    schema = closed_object({"colour": {"enum": ["red", "green", "blue"]}})
    out = openai_client(demo).chat.completions.create(
        model="m",
        messages=USER,
        n=2,
        seed=1,
        temperature=1.0,
        max_tokens=24,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    assert len(out.choices) == 2
    for c in out.choices:
        assert json.loads(c.message.content)["colour"] in ("red", "green", "blue")
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": closed_object(
                {"city": {"type": "string", "minLength": 1, "maxLength": 10}}
            ),
        },
    }
    calls = openai_client(demo).chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        n=2,
        tools=[tool],
        tool_choice="required",
        max_tokens=120,
        temperature=0.8,
        seed=3,
    )
    assert [c.index for c in calls.choices] == [0, 1]
    for c in calls.choices:
        assert c.finish_reason == "tool_calls"
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather"
        assert "city" in json.loads(call.function.arguments)
