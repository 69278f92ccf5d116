"""/v1/completions on a real ``mlx-server`` process: a tiny random model with FIM tokens."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from support import schema_validator, serving
from tiny_model import FIM_SPECIALS, build_tiny_model

RESPONSE = schema_validator("CreateCompletionResponse")


@pytest.fixture(scope="module")
def fim_server(tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("srv") / "tiny-fim", specials=FIM_SPECIALS)
    with serving(["-m", str(model), "--ctx-size", "256"]) as sp:
        yield sp


def post(srv, body: dict) -> httpx.Response:
    return httpx.post(srv.base_url + "/v1/completions", json=body, timeout=60)


def test_sdk_strict_non_stream_and_stream(fim_server):
    strict = openai.OpenAI(
        base_url=fim_server.base_url + "/v1", api_key="x", _strict_response_validation=True
    )
    r = strict.completions.create(model="m", prompt="The quick", max_tokens=6, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 6
    RESPONSE.validate(r.model_dump(exclude_unset=True))
    # Streamed, the same greedy text arrives in pieces.
    plain = openai.OpenAI(base_url=fim_server.base_url + "/v1", api_key="x")
    chunks = list(
        plain.completions.create(
            model="m", prompt="The quick", max_tokens=6, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_batch_matches_single_requests(fim_server):
    prompts = ["Hello world", "def add(a, b):", "Numbers 0 1 2"]
    body = {"max_tokens": 8, "temperature": 0}
    singles = [
        post(fim_server, {**body, "prompt": p}).json()["choices"][0]["text"] for p in prompts
    ]
    batch = post(fim_server, {**body, "prompt": prompts})
    assert batch.status_code == 200, batch.text
    RESPONSE.validate(batch.json())
    assert [c["text"] for c in batch.json()["choices"]] == singles
    assert [c["index"] for c in batch.json()["choices"]] == [0, 1, 2]


def test_fill_in_the_middle_generates(fim_server):
    r = post(
        fim_server,
        {"prompt": "def add(a, b):\n    return ", "suffix": "\n", "max_tokens": 5, "seed": 1},
    )
    assert r.status_code == 200, r.text
    RESPONSE.validate(r.json())
    # PRE + prefix + SUF + suffix + MID: more tokens than the prefix alone.
    alone = post(fim_server, {"prompt": "def add(a, b):\n    return ", "max_tokens": 0})
    assert r.json()["usage"]["prompt_tokens"] >= alone.json()["usage"]["prompt_tokens"] + 4


def test_ollama_generate_with_a_suffix_matches(fim_server):
    """Ollama's fill-in-the-middle (``/api/generate`` with ``suffix``) is the same prompt and
    the same greedy text as /v1/completions'."""
    prefix, suffix = "def add(a, b):\n    return ", "\n"
    v1 = {"prompt": prefix, "suffix": suffix, "max_tokens": 5, "temperature": 0}
    ref = post(fim_server, v1).json()
    body = {
        "model": "tiny",
        "prompt": prefix,
        "suffix": suffix,
        "stream": False,
        "options": {"num_predict": 5, "temperature": 0},
    }
    r = httpx.post(fim_server.base_url + "/api/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["response"] == ref["choices"][0]["text"]
    assert r.json()["prompt_eval_count"] == ref["usage"]["prompt_tokens"]


def test_legacy_logprobs_shape(fim_server):
    r = post(fim_server, {"prompt": "The quick", "max_tokens": 5, "logprobs": 2, "temperature": 0})
    RESPONSE.validate(r.json())
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    n = r.json()["usage"]["completion_tokens"]
    assert n > 0
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == n
    assert len(lp["top_logprobs"]) == n
    assert lp["text_offset"][0] == 0
    assert lp["text_offset"] == sorted(lp["text_offset"])
    for tok, logprob, top in zip(
        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
    ):
        assert logprob <= 0
        assert 1 <= len(top) <= 3 and top[tok] == pytest.approx(logprob)
        # Greedy: the chosen token is the most likely one.
        assert logprob == pytest.approx(max(top.values()))


def test_stream_logprobs_ride_on_text_chunks(fim_server):
    body = {"prompt": "Hello", "max_tokens": 4, "logprobs": 0, "stream": True, "temperature": 0}
    with httpx.stream("POST", fim_server.base_url + "/v1/completions", json=body) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    tokens = [t for e in events for t in ((e["choices"][0]["logprobs"] or {}).get("tokens") or [])]
    assert len(tokens) == events[-1]["usage"]["completion_tokens"]


def test_context_and_bad_ids_are_400(fim_server):
    r = post(fim_server, {"prompt": "x", "max_tokens": 300})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = post(fim_server, {"prompt": [1, 2, 99999]})
    assert r.status_code == 400 and "prompt[0]" in r.json()["error"]["message"]


@pytest.mark.demo
def test_demo_model_completes_text_and_has_no_fim(demo_server):
    r = post(
        demo_server,
        {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "echo": True},
    )
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert text.startswith("The capital of France is") and "Paris" in text
    # SmolLM2's vocabulary has StarCoder's <file_sep> family but no FIM tokens.
    r = post(demo_server, {"prompt": "def f(", "suffix": "):\n    pass\n"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    assert "<fim_prefix>" in r.json()["error"]["message"]


@pytest.mark.demo
def test_demo_completion_keeps_the_first_tokens_space(demo_server):
    """The text continues the prompt: it is its tokens' texts joined, the first one's
    leading space included (" Paris" after "The capital of France is")."""
    body = {
        "prompt": "The capital of France is",
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
    }
    r = post(demo_server, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    tokens = choice["logprobs"]["tokens"]
    assert len(tokens) == 6 and tokens[0].startswith(" ")
    assert choice["text"] == "".join(tokens)
    with httpx.stream(
        "POST", demo_server.base_url + "/v1/completions", json={**body, "stream": True}
    ) as s:
        events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == choice["text"]
