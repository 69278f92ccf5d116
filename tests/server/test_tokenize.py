"""/tokenize, /detokenize (llama.cpp's shapes) and /v1/chat/completions/count_tokens."""

from __future__ import annotations

import httpx
import pytest
from payloads import WEATHER


def post(srv, path: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, headers=headers, timeout=30)


def test_tokenize_matches_the_tokenizer(scripted, tiny_tokenizer):
    text = "Hello world! def add(a, b):"
    r = post(scripted, "/tokenize", {"content": text})
    assert r.status_code == 200
    assert r.json() == {"tokens": tiny_tokenizer.encode(text, add_special_tokens=False)}


def test_with_pieces_cover_the_text_bytes(scripted):
    text = "Hello héllo € 日本"
    r = post(scripted, "/tokenize", {"content": text, "with_pieces": True})
    tokens = r.json()["tokens"]
    assert all(set(t) == {"id", "piece"} for t in tokens)
    data = b"".join(
        t["piece"].encode() if isinstance(t["piece"], str) else bytes(t["piece"]) for t in tokens
    )
    assert data == text.encode()
    # The tiny vocabulary knows no CJK: those characters are split into byte tokens.
    assert any(isinstance(t["piece"], list) for t in tokens)
    assert isinstance(tokens[0]["piece"], str) and text.startswith(tokens[0]["piece"])


def test_parse_special(scripted, tiny_tokenizer):
    start = tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")
    parsed = post(scripted, "/tokenize", {"content": "<|im_start|>hi"}).json()["tokens"]
    assert parsed[0] == start
    plain = post(scripted, "/tokenize", {"content": "<|im_start|>hi", "parse_special": False})
    assert start not in plain.json()["tokens"] and len(plain.json()["tokens"]) > len(parsed)


def test_detokenize_round_trip_and_bad_ids(scripted, tiny_tokenizer):
    ids = tiny_tokenizer.encode("<|im_start|>The quick brown fox", add_special_tokens=False)
    r = post(scripted, "/detokenize", {"tokens": ids})
    assert r.json() == {"content": "<|im_start|>The quick brown fox"}
    for bad in ([1, 10**7], [-1], ["a"], "nope"):
        r = post(scripted, "/detokenize", {"tokens": bad})
        assert r.status_code == 400, bad
        assert "tokens" in r.json()["error"]["message"]
    assert post(scripted, "/tokenize", {"text": "x"}).status_code == 400  # content missing


def test_tokenizer_endpoints_need_the_key(scripted_factory):
    srv = scripted_factory(api_key="k")
    assert post(srv, "/tokenize", {"content": "x"}).status_code == 401
    assert post(srv, "/detokenize", {"tokens": [1]}).status_code == 401
    assert post(srv, "/v1/chat/completions/count_tokens", {"messages": []}).status_code == 401
    assert post(srv, "/tokenize", {"content": "x"}, **{"x-api-key": "k"}).status_code == 200


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"tools": [WEATHER]},
        {"tools": [WEATHER], "tool_choice": "none"},
        {"chat_template_kwargs": {"enable_thinking": False}},
    ],
)
def test_chat_count_tokens_equals_prompt_usage(scripted, extra):
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the weather in Paris?"},
        ],
        **extra,
    }
    count = post(scripted, "/v1/chat/completions/count_tokens", body)
    assert count.status_code == 200, count.text
    assert count.json()["object"] == "chat.completion.input_tokens"
    scripted.engine.push("ok")
    usage = post(scripted, "/v1/chat/completions", body).json()["usage"]
    assert count.json()["input_tokens"] == usage["prompt_tokens"]
    assert scripted.engine.requests[-1].prompt_tokens  # it did go to the engine then
    n_requests = len(scripted.engine.requests)
    post(scripted, "/v1/chat/completions/count_tokens", body)
    assert len(scripted.engine.requests) == n_requests  # counting generates nothing


def test_count_tokens_grows_with_tools_and_rejects_bad_bodies(scripted):
    base = {"messages": [{"role": "user", "content": "hi"}]}
    plain = post(scripted, "/v1/chat/completions/count_tokens", base).json()["input_tokens"]
    tools = post(scripted, "/v1/chat/completions/count_tokens", {**base, "tools": [WEATHER]})
    assert tools.json()["input_tokens"] > plain
    r = post(scripted, "/v1/chat/completions/count_tokens", {"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
