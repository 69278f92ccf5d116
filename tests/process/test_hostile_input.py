"""Edge and hostile input gets a 4xx in the protocol's own envelope, never a 500, and leaves
the server serving: out-of-range sampling parameters, deep JSON, lone surrogates, paths that
only match once decoded, a client that hangs up mid-upload, and an internal fault."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
USER = [{"role": "user", "content": "hi"}]


def post(srv, path: str, body: dict | str, **kw) -> httpx.Response:
    data = body if isinstance(body, str) else json.dumps(body)
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return httpx.post(srv.base_url + path, content=data, headers=headers, timeout=30, **kw)


def openai_error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def anthropic_error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error"
    return body["error"]


def still_serves(srv) -> None:
    srv.engine.push("ok")
    r = post(srv, CHAT, {"model": "m", "messages": USER})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"


@pytest.mark.parametrize("seed", [1 << 64, -(1 << 63) - 1, 10**30])
def test_a_seed_outside_64_bits_is_a_400(scripted, seed):
    err = openai_error(post(scripted, CHAT, {"model": "m", "messages": USER, "seed": seed}))
    assert err["param"] == "seed" and err["type"] == "invalid_request_error"
    still_serves(scripted)


@pytest.mark.parametrize("seed", [-1, -(1 << 63), (1 << 64) - 1, 0])
def test_a_seed_within_64_bits_is_accepted(scripted, seed):
    scripted.engine.push("x")
    r = post(scripted, CHAT, {"model": "m", "messages": USER, "seed": seed, "temperature": 1})
    assert r.status_code == 200, r.text


def test_top_k_at_or_beyond_the_vocabulary_is_a_400_on_both_apis(scripted):
    vocab = scripted.service.vocab_size
    assert vocab > 0
    body = {"model": "m", "messages": USER, "top_k": vocab, "temperature": 1}
    err = openai_error(post(scripted, CHAT, body))
    assert err["param"] == "top_k" and str(vocab) in err["message"]
    body = {"model": "m", "max_tokens": 8, "messages": USER, "top_k": vocab + 5}
    aerr = anthropic_error(post(scripted, MESSAGES, body))
    assert aerr["type"] == "invalid_request_error" and "top_k" in aerr["message"]
    scripted.engine.push("fine")
    ok = post(scripted, CHAT, {"model": "m", "messages": USER, "top_k": vocab - 1})
    assert ok.status_code == 200


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("path", [CHAT, MESSAGES, COUNT, "/v1/cancel"])
@pytest.mark.parametrize("depth", [150, 1000, 100_000])
def test_deeply_nested_json_is_a_400_on_every_post_route(scripted, path, depth):
    body = '{"model": "m", "max_tokens": 5, "messages": ' + nested(depth) + "}"
    r = post(scripted, path, body)
    if path.startswith(MESSAGES):
        assert "nests JSON deeper" in anthropic_error(r)["message"]
    else:
        assert "nests JSON deeper" in openai_error(r)["message"]
    still_serves(scripted)


def test_moderately_nested_json_is_accepted(scripted_factory):
    scripted = scripted_factory(ctx_size=4096)
    schema: dict = {"type": "string"}
    for _ in range(20):
        schema = {"type": "object", "properties": {"a": schema}}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    scripted.engine.push("x")
    r = post(scripted, CHAT, {"model": "m", "messages": USER, "tools": [tool]})
    assert r.status_code == 200, r.text


SURROGATE = "\\ud800"  # as written in the JSON text: valid JSON, not valid text


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, '{"model": "%s", "messages": [{"role": "user", "content": "hi"}]}', "model"),
        (
            CHAT,
            '{"model": "m", "messages": [{"role": "us%ser", "content": "hi"}]}',
            "messages[0].role",
        ),
        (
            CHAT,
            '{"model": "m", "messages": [{"role": "user", "content": "a%sb"}]}',
            "messages[0].content",
        ),
        (
            CHAT,
            '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f%s"}}]}',
            "tools[0].function.name",
        ),
        (
            MESSAGES,
            '{"model": "m", "max_tokens": 5, "system": "s%s", "messages": [{"role": "user", "content": "hi"}]}',
            "system",
        ),
        (
            MESSAGES,
            '{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}]}',
            "messages[0].content[0].text",
        ),
        (
            COUNT,
            '{"model": "m", "messages": [{"role": "user", "content": "x%s"}]}',
            "messages[0].content",
        ),
        (
            COUNT,
            '{"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "t%s", "input_schema": {"type": "object"}}]}',
            "tools[0].name",
        ),
    ],
)
def test_lone_surrogates_are_a_400_naming_the_field(scripted, path, body, param):
    r = post(scripted, path, body % SURROGATE)
    if path.startswith(MESSAGES):
        assert param in anthropic_error(r)["message"]
    else:
        err = openai_error(r)
        assert err["param"] == param and "surrogate" in err["message"]
    still_serves(scripted)


def test_paired_surrogates_are_ordinary_text(scripted):
    scripted.engine.push("x")
    body = '{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
    assert post(scripted, CHAT, body).status_code == 200


@pytest.mark.parametrize(
    "path",
    ["/v1/chat/completions/", "/v1/chat%2Fcompletions", "/v1/chat%2fcompletions", "/v1/%6dessages"],
)
def test_paths_match_exactly(scripted, path):
    r = httpx.post(scripted.base_url + path, json={"model": "m", "messages": USER})
    assert r.status_code == 404, (r.status_code, r.headers)
    assert "location" not in r.headers
    assert r.json()["error"]["type"] == "not_found_error"


def test_an_internal_fault_is_a_500_that_closes_the_connection(scripted, monkeypatch):
    async def broken(*a, **k):
        raise RuntimeError("broken on purpose")

    monkeypatch.setattr(scripted.service, "start", broken)
    with httpx.Client(base_url=scripted.base_url) as c:
        r = c.post(CHAT, json={"model": "m", "messages": USER})
    err = openai_error(r, 500)
    assert err["type"] == "server_error" and "RuntimeError" in err["message"]
    assert r.headers.get("connection") == "close"
    monkeypatch.undo()
    still_serves(scripted)


def test_a_client_hanging_up_mid_upload_is_quiet(scripted, capfd):
    host, port = scripted.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n"
            b'{"model": "m", "messages": ['
        )
    seen = ""
    deadline = time.monotonic() + 30
    while "before its body arrived" not in seen and time.monotonic() < deadline:
        time.sleep(0.05)
        seen += "".join(capfd.readouterr())
    assert "before its body arrived" in seen
    assert "Traceback" not in seen and "Error processing request" not in seen
    still_serves(scripted)


def _no_constants(name: str):
    raise ValueError(f"{name} is not JSON")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "constraint",
    [
        {"response_format": {"type": "json_object"}},
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "tool_choice": "required",
        },
    ],
)
def test_logprobs_of_constrained_output_are_valid_json(tiny_server, stream, constraint):
    """A grammar masks most of the vocabulary (-inf): masked tokens are left out of
    top_logprobs rather than written as -Infinity, which is not JSON."""
    body = {
        "model": "m",
        "messages": USER,
        "max_tokens": 6,
        "logprobs": True,
        "top_logprobs": 20,
        "stream": stream,
        **constraint,
    }
    r = httpx.post(tiny_server.base_url + CHAT, json=body, timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        frames = [x[6:] for x in r.text.split("\n") if x.startswith("data: {")]
        chunks = [json.loads(f, parse_constant=_no_constants) for f in frames]
        entries = [
            e
            for c in chunks
            if c["choices"]
            for e in (c["choices"][0].get("logprobs") or {}).get("content") or []
        ]
    else:
        out = json.loads(r.text, parse_constant=_no_constants)
        entries = out["choices"][0]["logprobs"]["content"]
    assert entries
    for e in entries:
        assert len(e["top_logprobs"]) <= 20
        assert all(t["logprob"] > -1e30 for t in e["top_logprobs"])
    # Only a few tokens may start a JSON value or a tool call: the lists were cut short.
    assert min(len(e["top_logprobs"]) for e in entries) < 20
