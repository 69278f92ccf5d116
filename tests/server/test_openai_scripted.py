"""OpenAI protocol through the real server stack, driven by a scripted engine."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from clients import openai_client, sse_data, wait_until
from payloads import chat, openai_tool_round_trip
from support import schema_validator

COMPLETION = schema_validator("CreateChatCompletionResponse")
CHUNK = schema_validator("CreateChatCompletionStreamResponse")
ERROR = schema_validator("ErrorResponse")


def test_non_stream_response_is_valid(scripted):
    scripted.engine.push("Hello", " world", "!")
    r = openai_client(scripted).chat.completions.create(
        model="anything", messages=[{"role": "user", "content": "hi"}]
    )
    assert r.choices[0].message.content == "Hello world!"
    assert r.choices[0].finish_reason == "stop"
    assert r.model == "anything"
    assert r.id.startswith("chatcmpl-")
    assert r.usage.completion_tokens == 3
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 3
    raw = r.model_dump(exclude_unset=True)
    COMPLETION.validate(raw)


def test_stream_chunks_are_valid_and_ordered(scripted):
    scripted.engine.push("A", "B", "C")
    body = chat("hi", stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", scripted.base_url + "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["cache-control"] == "no-cache"
        lines = list(resp.iter_lines())
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    for e in events:
        CHUNK.validate(e)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == "ABC"
    final = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(final) == 1 and final[0]["choices"][0]["finish_reason"] == "stop"
    t = final[0]["timings"]
    for k in (
        "prompt_n",
        "prompt_ms",
        "prompt_per_second",
        "predicted_n",
        "predicted_ms",
        "predicted_per_second",
    ):
        assert k in t
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    # With include_usage the spec's usage chunk alone carries usage.
    assert [e for e in events if e.get("usage")] == [events[-1]]


def test_stream_without_include_usage_puts_usage_on_the_final_chunk(scripted):
    scripted.engine.push("A", "B")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", scripted.base_url + "/v1/chat/completions", json=body) as resp:
        events = [json.loads(x[6:]) for x in resp.iter_lines() if x.startswith("data: {")]
    with_usage = [e for e in events if e.get("usage")]
    assert len(with_usage) == 1 and with_usage[0]["choices"][0]["finish_reason"] == "stop"
    assert with_usage[0]["usage"]["completion_tokens"] == 2


def test_sdk_stream(scripted):
    scripted.engine.push("x", "y")
    chunks = list(
        openai_client(scripted).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "xy"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_split_across_pieces_never_leaks(scripted, stream):
    scripted.engine.push("The answer", " is EN", "D and more", " text")
    c = openai_client(scripted)
    kw = dict(model="m", messages=[{"role": "user", "content": "hi"}], stop=["END"])
    if stream:
        text = "".join(
            ch.choices[0].delta.content or ""
            for ch in c.chat.completions.create(stream=True, **kw)
            if ch.choices
        )
    else:
        r = c.chat.completions.create(**kw)
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"
    assert text == "The answer is "


def test_stop_as_plain_string(scripted):
    scripted.engine.push("one, two, three")
    r = openai_client(scripted).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stop=", "
    )
    assert r.choices[0].message.content == "one"


def test_finish_reason_length(scripted):
    scripted.engine.push(*["w "] * 10)
    r = openai_client(scripted).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3


def test_context_length_exceeded(scripted):
    r = httpx.post(
        scripted.base_url + "/v1/chat/completions",
        json=chat("hi " * 50, max_tokens=500),
    )
    assert r.status_code == 400
    err = r.json()["error"]
    ERROR.validate(r.json())
    assert err["code"] == "context_length_exceeded"
    assert "500" in err["message"] and "512" in err["message"]


def test_whole_conversation_reaches_template(scripted):
    scripted.engine.push("ok")
    msgs = [
        {"role": "system", "content": "S1"},
        {"role": "developer", "content": "D1"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "U1"}, {"type": "text", "text": "U2"}],
        },
        *openai_tool_round_trip("f", '{"a": 1}', "R1"),
    ]
    r = httpx.post(
        scripted.base_url + "/v1/chat/completions", json={"model": "m", "messages": msgs}
    )
    assert r.status_code == 200, r.text
    req = scripted.engine.requests[-1]
    text = scripted.service.tokenizer.decode(req.prompt_tokens)
    for piece in ("S1", "D1", "U1\nU2", '"name": "f"', "R1", "<|im_start|>tool"):
        assert piece in text
    assert text.index("S1") < text.index("D1") < text.index("U1") < text.index("R1")


def test_cancel_all_and_by_id(scripted):
    import threading

    eng = scripted.engine
    eng.push(*["x"] * 200, delay=0.02)
    eng.push(*["y"] * 200, delay=0.02)
    results = {}

    def run(key):
        with httpx.stream(
            "POST",
            scripted.base_url + "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": key}], "stream": True},
            timeout=30,
        ) as resp:
            results[key] = sse_data(resp.iter_lines())

    threads = [threading.Thread(target=run, args=(k,)) for k in ("a", "b")]
    for t in threads:
        t.start()
    wait_until(lambda: eng.active_count == 2, "both generations to run", timeout=5)
    first_id = eng.requests[0].request_id
    r = httpx.post(scripted.base_url + "/v1/cancel", json={"id": first_id})
    assert r.json() == {"status": "cancelled", "cancelled_count": 1}
    wait_until(lambda: eng.active_count == 1, "the cancelled one to end", timeout=5)
    r = httpx.post(scripted.base_url + "/v1/cancel", json={})
    assert r.json() == {"status": "cancelled", "cancelled_count": 1}
    for t in threads:
        t.join(10)
    assert eng.active_count == 0
    r = httpx.post(scripted.base_url + "/v1/cancel")
    assert r.json() == {"status": "no_active_generation", "cancelled_count": 0}
    for evs in results.values():
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in evs if e["choices"])
        assert 0 < len(text) < 200


def test_cancel_non_streaming(scripted):
    import threading

    eng = scripted.engine
    eng.push(*["x"] * 500, delay=0.01)
    out = {}
    t = threading.Thread(
        target=lambda: out.setdefault(
            "r",
            httpx.post(
                scripted.base_url + "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "a"}]},
                timeout=30,
            ),
        )
    )
    t.start()
    wait_until(lambda: eng.active_count == 1, "the generation to run", timeout=5)
    assert httpx.post(scripted.base_url + "/v1/cancel", json={}).json()["cancelled_count"] == 1
    t.join(10)
    assert out["r"].status_code == 200
    assert len(out["r"].json()["choices"][0]["message"]["content"]) < 500


def test_disconnect_stops_generation(scripted):
    eng = scripted.engine
    eng.push(*["x"] * 1000, delay=0.01)
    with httpx.stream(
        "POST",
        scripted.base_url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "a"}], "stream": True},
    ) as resp:
        it = resp.iter_lines()
        for _ in range(5):
            next(it)
    wait_until(lambda: eng.active_count == 0, "the generation to stop", timeout=5)


def test_error_after_stream_began(scripted):
    scripted.engine.push("partial", finish="error")
    with httpx.stream(
        "POST",
        scripted.base_url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "a"}], "stream": True},
    ) as resp:
        lines = [x for x in resp.iter_lines() if x]
    assert any(x.startswith("error: ") and json.loads(x[7:])["message"] for x in lines)
    data_err = [json.loads(x[6:]) for x in lines if x.startswith('data: {"error"')]
    assert data_err and ERROR.validate(data_err[0]) is None
    assert "data: [DONE]" not in lines
    assert httpx.get(scripted.base_url + "/health").status_code == 200


def test_models_and_health(scripted):
    r = httpx.get(scripted.base_url + "/v1/models").json()
    assert (
        r["object"] == "list"
        and r["data"][0]["id"] == "scripted-model"
        and r["data"][0]["owned_by"] == "mlx"
    )
    schema_validator("ListModelsResponse").validate(r)
    h = httpx.get(scripted.base_url + "/health").json()
    assert h["status"] == "ok"
    assert openai_client(scripted).models.list().data[0].id == "scripted-model"


def test_a_model_that_failed_after_readiness_says_why_everywhere(scripted):
    """Its first token failed after the readiness line (a cold kernel cache): /health and
    every generation route answer 503 with the reason, in each protocol's envelope."""
    scripted.engine.start_error = "the model could not compute a token: nvrtc failed"
    h = httpx.get(scripted.base_url + "/health")
    assert h.status_code == 503
    assert h.json()["status"] == "error" and "nvrtc failed" in h.json()["error"]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(scripted.base_url + "/v1/chat/completions", json=body)
    assert r.status_code == 503 and ERROR.validate(r.json()) is None
    assert "cannot serve" in r.json()["error"]["message"]
    a = httpx.post(scripted.base_url + "/v1/messages", json={**body, "max_tokens": 8})
    assert a.status_code == 503 and a.json()["type"] == "error"
    assert "nvrtc failed" in a.json()["error"]["message"]
    with pytest.raises(openai.InternalServerError, match="nvrtc failed"):
        openai_client(scripted).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
    assert scripted.engine.requests == []


BAD = [
    ("malformed json", b'{"model": "m", "messages": [', "application/json", "not valid JSON"),
    ("form encoded", b"model=m&messages=x", "application/x-www-form-urlencoded", "not valid JSON"),
    ("not an object", b"[1, 2]", "application/json", "JSON object"),
    (
        "empty messages",
        json.dumps({"model": "m", "messages": []}).encode(),
        "application/json",
        "messages",
    ),
    ("missing messages", json.dumps({"model": "m"}).encode(), "application/json", "messages"),
    (
        "messages wrong type",
        json.dumps({"model": "m", "messages": "hi"}).encode(),
        "application/json",
        "messages",
    ),
    (
        "unknown role",
        json.dumps({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}).encode(),
        "application/json",
        "role",
    ),
    (
        "negative max_tokens",
        json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}
        ).encode(),
        "application/json",
        "max_tokens",
    ),
    (
        "negative temperature",
        json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": -0.5}
        ).encode(),
        "application/json",
        "temperature",
    ),
    (
        "top_logprobs too big",
        json.dumps(chat("x", logprobs=True, top_logprobs=21)).encode(),
        "application/json",
        "top_logprobs",
    ),
    (
        "temperature string",
        json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}
        ).encode(),
        "application/json",
        "temperature",
    ),
    (
        "response_format unknown type",
        json.dumps(chat("x", response_format={"type": "xml"})).encode(),
        "application/json",
        "response_format",
    ),
    (
        "bad tool call args",
        json.dumps(
            {
                "model": "m",
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "a",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{nope"},
                            }
                        ],
                    }
                ],
            }
        ).encode(),
        "application/json",
        "arguments",
    ),
]


@pytest.mark.parametrize("name,body,ctype,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gives_400_and_server_survives(scripted, name, body, ctype, needle):
    r = httpx.post(
        scripted.base_url + "/v1/chat/completions", content=body, headers={"content-type": ctype}
    )
    assert r.status_code == 400, r.text
    ERROR.validate(r.json())
    assert needle in r.json()["error"]["message"], r.json()
    scripted.engine.push("fine")
    ok = httpx.post(
        scripted.base_url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "fine"


def test_huge_body_413(scripted):
    big = (
        b'{"model": "m", "messages": [{"role": "user", "content": "'
        + b"a" * (11 * 1024 * 1024)
        + b'"}]}'
    )
    r = httpx.post(
        scripted.base_url + "/v1/chat/completions",
        content=big,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413
    ERROR.validate(r.json())


def test_unknown_path_404_and_wrong_method_405(scripted):
    r = httpx.get(scripted.base_url + "/v1/nope")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(scripted.base_url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_auth_on_every_v1_route(scripted_factory):
    srv = scripted_factory(api_key="s3cret+/=")
    routes = [
        ("GET", "/v1/models", None),
        (
            "POST",
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "x"}]},
        ),
        ("POST", "/v1/cancel", {}),
    ]
    for method, path, body in routes:
        r = httpx.request(method, srv.base_url + path, json=body)
        assert r.status_code == 401
        assert r.json() == {
            "error": {
                "message": "Unauthorized",
                "type": "authentication_error",
                "code": "unauthorized",
            }
        }
        r = httpx.request(
            method, srv.base_url + path, json=body, headers={"Authorization": "Bearer wrong"}
        )
        assert r.status_code == 401
        r = httpx.request(
            method, srv.base_url + path, json=body, headers={"Authorization": "Bearer s3cret+/="}
        )
        assert r.status_code == 200, (path, r.text)
        r = httpx.request(
            method, srv.base_url + path, json=body, headers={"x-api-key": "s3cret+/="}
        )
        assert r.status_code == 200
    assert httpx.get(srv.base_url + "/health").status_code == 200
    assert openai_client(srv, api_key="s3cret+/=").models.list().data
    with pytest.raises(openai.AuthenticationError):
        openai_client(srv, api_key="nope").models.list()


def test_unknown_fields_ignored_and_model_echoed(scripted):
    scripted.engine.push("ok")
    r = httpx.post(
        scripted.base_url + "/v1/chat/completions",
        json={
            "model": "whatever-name",
            "messages": [{"role": "user", "content": "x"}],
            "frobnicate": 1,
            "n": 1,
        },
    )
    assert r.status_code == 200 and r.json()["model"] == "whatever-name"


def test_sampling_params_reach_engine(scripted):
    scripted.engine.push("ok")
    httpx.post(
        scripted.base_url + "/v1/chat/completions",
        json=chat(
            "x",
            temperature=0.3,
            top_p=0.9,
            top_k=5,
            min_p=0.1,
            seed=7,
            repetition_penalty=1.1,
            max_completion_tokens=9,
        ),
    )
    req = scripted.engine.requests[-1]
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed, s.repetition_penalty) == (
        0.3,
        0.9,
        5,
        0.1,
        7,
        1.1,
    )
    assert req.max_tokens == 9
