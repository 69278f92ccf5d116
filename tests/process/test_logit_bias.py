"""``logit_bias`` on the demo model (greedy): forcing and banning tokens, in a batch next to
a request without a bias, on chat and text completions; and its validation."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from payloads import closed_object
from support import ServerProcess

MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture
def demo(demo_server: ServerProcess) -> ServerProcess:
    return demo_server  # the session's demo-model server (conftest.py)


def token_ids(srv, text: str) -> list[int]:
    r = httpx.post(f"{srv.base_url}/tokenize", json={"content": text}, timeout=30)
    r.raise_for_status()
    return r.json()["tokens"]


def chat(srv, **extra) -> dict:
    body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 6, **extra}
    r = httpx.post(f"{srv.base_url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def content(resp: dict) -> str:
    return resp["choices"][0]["message"]["content"]


def tokens_of(resp: dict) -> list[str]:
    return [e["token"] for e in resp["choices"][0]["logprobs"]["content"]]


@pytest.mark.demo
@pytest.mark.timeout(600)  # demo-model generations: up to 3 minutes on a loaded 2-core machine
def test_force_and_ban_in_one_batch(demo):
    plain = chat(demo, logprobs=True)
    first = tokens_of(plain)[0]
    (first_id,) = token_ids(demo, first)
    (forced_id,) = token_ids(demo, " banana")
    bodies = [
        {"logprobs": True},
        {"logprobs": True, "logit_bias": {str(forced_id): 100}},
        {"logprobs": True, "logit_bias": {str(first_id): -100}},
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        again, forced, banned = pool.map(lambda b: chat(demo, **b), bodies)
    assert content(again) == content(plain)  # the batch neighbours change nothing here
    assert tokens_of(forced) == [" banana"] * 6
    assert content(forced) == (" banana" * 6).lstrip()  # the answer's leading space goes
    assert tokens_of(banned)[0] != first
    assert first not in tokens_of(banned)


@pytest.mark.demo
def test_bias_on_text_completions_and_with_a_schema(demo):
    (forced_id,) = token_ids(demo, " banana")
    r = httpx.post(
        f"{demo.base_url}/v1/completions",
        json={
            "prompt": "My favourite fruit is",
            "temperature": 0,
            "max_tokens": 3,
            "logprobs": 0,
            "logit_bias": {str(forced_id): 100},
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"]["tokens"] == [" banana"] * 3
    # A constraint's mask wins over a bias: the answer is still the schema's JSON.
    schema = closed_object({"ok": {"type": "boolean"}})
    resp = chat(
        demo,
        max_tokens=20,
        logit_bias={str(forced_id): 100},
        response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": schema}},
    )
    assert json.loads(content(resp)) in ({"ok": True}, {"ok": False})


@pytest.mark.demo
def test_sdk_strict_client(demo):
    (forced_id,) = token_ids(demo, " yes")
    client = openai.OpenAI(
        base_url=f"{demo.base_url}/v1", api_key="x", max_retries=0, _strict_response_validation=True
    )
    out = client.chat.completions.create(
        model="demo",
        messages=MESSAGES,
        temperature=0,
        max_tokens=2,
        logit_bias={str(forced_id): 100},
    )
    assert out.choices[0].message.content == "yes yes"


@pytest.mark.parametrize(
    ("bias", "param"),
    [
        ({"999999999": 5}, "logit_bias.999999999"),
        ({"12": 100.5}, "logit_bias.12"),
        ({"12": -101}, "logit_bias.12"),
        ({"hello": 1}, "logit_bias.hello"),
        ({"-3": 1}, "logit_bias.-3"),
        ({"12": "much"}, "logit_bias.12"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_invalid_logit_bias_is_a_400_naming_the_key(scripted, bias, param, path):
    body = {"logit_bias": bias, "max_tokens": 2}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": "hi"})
    r = httpx.post(f"{scripted.base_url}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_bias_row_is_added_in_one_operation():
    import mlx.core as mx

    from mlx_server.engine.sampling.samplers import make_processors
    from mlx_server.types import SamplingParams

    (process,) = make_processors(SamplingParams(logit_bias=((1, 5.0), (3, -100.0), (99, 1.0))))
    logits = mx.zeros((1, 4), dtype=mx.float16)
    out = process(mx.array([0]), logits)
    assert out.dtype == mx.float16
    assert out.tolist() == [[0.0, 5.0, 0.0, -100.0]]
    assert process(mx.array([0]), out).tolist() == [[0.0, 10.0, 0.0, -200.0]]


def test_bias_comes_before_the_penalties():
    import mlx.core as mx

    from mlx_server.engine.sampling.samplers import make_processors
    from mlx_server.types import SamplingParams

    params = SamplingParams(logit_bias=((1, 5.0),), presence_penalty=1.0, frequency_penalty=0.5)
    logits = mx.zeros((1, 3))
    for process in make_processors(params):
        logits = process(mx.array([1, 1]), logits)
    # +5 bias on token 1, then -1 presence and -0.5 x 2 frequency for its two occurrences.
    assert logits.tolist() == [[0.0, 3.0, 0.0]]
