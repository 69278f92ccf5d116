"""What Jan and other clients read from the server, over the real HTTP stack on the scripted
engine: the context-overflow 400 on all four APIs (the phrases context-overflow detectors look
for, llama.cpp's fields), the OpenAI routes without ``/v1`` (auth and the browser guard
exactly as on the originals), ``HEAD``/``GET /health`` and the context sizes reported."""

from __future__ import annotations

import httpx
import openai
import pytest
from support import ERROR as ANTHROPIC_ERROR
from support import schema_validator

from mlx_server.protocols.openai.errors import JAN_UNAUTHORIZED

OPENAI_ERROR = schema_validator("ErrorResponse")
KEY = "q+3/Zx9vL0Q1rT7sB2mN8kP4wY6hJ5cV0aE1fG2dH3I="  # shaped like Jan's (base64 HMAC)
CTX = 512

# What context-overflow detectors look for, each from where it is used:
# Jan's extension and app (`the request exceeds the available context size`, llama.cpp's
# wording, on which Jan reloads the model with a larger --ctx-size), OpenAI's message
# (`maximum context length is`) and its code (`context_length_exceeded`), which agent
# frameworks (LiteLLM, OpenHands, Codex-style clients) also search the message for.
DETECTOR_PHRASES = (
    "the request exceeds the available context size",
    "exceeds the available context size",
    "maximum context length is",
    "context_length_exceeded",
)

WORDS = "word " * 600  # more tokens than the context holds


def _chat(max_tokens: int | None, text: str = "hello") -> tuple[str, dict]:
    body: dict = {"model": "m", "messages": [{"role": "user", "content": text}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return "/v1/chat/completions", body


def _completions(max_tokens: int | None, text: str = "hello") -> tuple[str, dict]:
    # max_tokens defaults to 16 on this API: a too-long prompt still overflows.
    body: dict = {"model": "m", "prompt": text}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return "/v1/completions", body


def _messages(max_tokens: int | None, text: str = "hello") -> tuple[str, dict]:
    body = {
        "model": "m",
        "max_tokens": max_tokens or 16,
        "messages": [{"role": "user", "content": text}],
    }
    return "/v1/messages", body


def _responses(max_tokens: int | None, text: str = "hello") -> tuple[str, dict]:
    body: dict = {"model": "m", "input": text}
    if max_tokens is not None:
        body["max_output_tokens"] = max_tokens
    return "/v1/responses", body


APIS = {"chat": _chat, "completions": _completions, "messages": _messages, "responses": _responses}


def _prompt_tokens(srv, api: str, text: str) -> int:
    """The prompt's token count, from a request that fits."""
    path, body = APIS[api](4, text)
    srv.engine.push("ok")
    r = httpx.post(srv.base_url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return usage.get("prompt_tokens", usage.get("input_tokens"))


def _error_object(api: str, r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    body = r.json()
    (ANTHROPIC_ERROR if api == "messages" else OPENAI_ERROR).validate(body)
    return body["error"]


@pytest.mark.parametrize("api", sorted(APIS))
def test_overflow_with_max_tokens_is_recognised_by_every_detector(scripted, api):
    n = _prompt_tokens(scripted, api, "hello")
    path, body = APIS[api](1000, "hello")
    err = _error_object(api, httpx.post(scripted.base_url + path, json=body, timeout=30))
    for phrase in DETECTOR_PHRASES:
        assert phrase in err["message"], (phrase, err["message"])
    assert err["code"] == "context_length_exceeded"
    assert (err["n_prompt_tokens"], err["n_ctx"]) == (n, CTX)
    assert f"prompt {n} tokens + max_tokens 1000" in err["message"]
    scripted.engine.push("still serving")
    path, body = APIS[api](4, "hello")
    assert httpx.post(scripted.base_url + path, json=body, timeout=30).status_code == 200


@pytest.mark.parametrize("api", sorted(APIS))
def test_a_prompt_longer_than_the_context_is_recognised_too(scripted, api):
    path, body = APIS[api](None, WORDS)
    err = _error_object(api, httpx.post(scripted.base_url + path, json=body, timeout=30))
    for phrase in DETECTOR_PHRASES:
        assert phrase in err["message"], (phrase, err["message"])
    assert err["code"] == "context_length_exceeded"
    assert err["n_prompt_tokens"] > CTX - 16 and err["n_ctx"] == CTX


def test_the_sdk_raises_a_bad_request_carrying_the_fields(scripted):
    c = openai.OpenAI(
        base_url=scripted.base_url + "/v1",
        api_key="x",
        max_retries=0,
        _strict_response_validation=True,
    )
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5000
        )
    assert e.value.code == "context_length_exceeded"
    assert isinstance(e.value.body, dict) and e.value.body["n_ctx"] == CTX


# ---- routes without /v1 ---------------------------------------------------------------


def _alias_requests() -> list[tuple[str, str, dict | None]]:
    return [
        ("GET", "/models", None),
        ("POST", "/chat/completions", _chat(4)[1]),
        ("POST", "/completions", _completions(4)[1]),
        ("POST", "/responses", _responses(4)[1]),
        ("POST", "/chat/completions/count_tokens", _chat(4)[1]),
    ]


@pytest.mark.parametrize(("method", "path", "body"), _alias_requests())
def test_openai_routes_answer_without_v1_and_need_the_key_as_the_originals(
    scripted_factory, method, path, body
):
    srv = scripted_factory(api_key=KEY)
    for prefix in ("", "/v1"):
        r = httpx.request(method, srv.base_url + prefix + path, json=body, timeout=30)
        assert r.status_code == 401, (prefix, r.text)
        assert r.json() == JAN_UNAUTHORIZED
        srv.engine.push("ok")
        auth = {"Authorization": f"Bearer {KEY}"}
        r = httpx.request(method, srv.base_url + prefix + path, json=body, headers=auth, timeout=30)
        assert r.status_code == 200, (prefix, r.text)


def test_aliases_work_without_a_key_and_give_the_same_answer(scripted):
    a = httpx.get(scripted.base_url + "/models", timeout=10).json()
    b = httpx.get(scripted.base_url + "/v1/models", timeout=10).json()
    for body in (a, b):
        for entry in body["data"]:
            entry.pop("created")
    assert a == b
    scripted.engine.push("Hi there")
    r = httpx.post(scripted.base_url + "/chat/completions", json=_chat(8)[1], timeout=30)
    assert r.json()["choices"][0]["message"]["content"] == "Hi there"
    c = openai.OpenAI(
        base_url=scripted.base_url, api_key="x", max_retries=0, _strict_response_validation=True
    )
    scripted.engine.push("stored")
    made = c.responses.create(model="m", input="hello", max_output_tokens=4)
    assert c.responses.retrieve(made.id).output_text == "stored"  # GET /responses/{id}


def test_aliases_get_the_browser_guard(scripted):
    evil = {"Origin": "http://evil.example"}
    for path in ("/chat/completions", "/v1/chat/completions"):
        r = httpx.post(scripted.base_url + path, json=_chat(4)[1], headers=evil, timeout=10)
        assert r.status_code == 403, (path, r.text)
    rebound = {"Host": "attacker.example"}
    for path in ("/models", "/v1/models"):
        assert httpx.get(scripted.base_url + path, headers=rebound, timeout=10).status_code == 403


def test_only_openai_routes_are_aliased(scripted):
    assert httpx.post(scripted.base_url + "/messages", json=_messages(4)[1]).status_code == 404
    assert httpx.get(scripted.base_url + "/nothing-here", timeout=10).status_code == 404
    r = httpx.get(scripted.base_url + "/chat/completions", timeout=10)
    assert r.status_code == 405  # a wrong method on an alias: as on the original


def test_a_v1_route_added_later_gets_its_alias(scripted):
    app = scripted.server.config.app

    async def probe() -> dict:
        return {"object": "list", "data": []}

    app.add_api_route("/v1/later-route", probe, methods=["POST"])
    r = httpx.post(scripted.base_url + "/later-route", json={}, timeout=10)
    assert r.status_code == 200 and r.json() == {"object": "list", "data": []}


# ---- health and the context sizes -----------------------------------------------------


def test_health_answers_head_and_get(scripted):
    head = httpx.head(scripted.base_url + "/health", timeout=10)
    assert head.status_code == 200 and head.content == b""
    body = httpx.get(scripted.base_url + "/health", timeout=10).json()
    assert body["status"] == "ok"


def test_models_and_health_report_the_context_sizes(scripted_factory):
    srv = scripted_factory(trained_ctx=8192)
    c = openai.OpenAI(
        base_url=srv.base_url + "/v1", api_key="x", max_retries=0, _strict_response_validation=True
    )
    entry = c.models.list().data[0].model_dump()
    health = httpx.get(srv.base_url + "/health", timeout=10).json()
    for where in (entry, health):
        assert where["context_length"] == CTX
        assert where["max_context_length"] == 8192
        assert where["meta"] == {"n_ctx": CTX, "n_ctx_train": 8192}
