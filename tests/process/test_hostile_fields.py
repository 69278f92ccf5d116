"""Fields the body's own checks do not see into, and values the sampler or the queue could
never take, get a 4xx in the protocol's envelope before anything starts, never a 500 or a
503 to retry: a call's ``arguments`` sent as JSON text (nested past the interpreter's
stack, or holding a lone surrogate), a Responses item's role or id of the wrong type,
Ollama options that are NaN or out of range, a completions batch larger than the queue,
and a schema with no value at all. The tokenizer routes leave the event loop free."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from mlx_server.engine.grammar.constraints import ConstraintCompiler

CHAT = "/v1/chat/completions"
USER = {"role": "user", "content": "hi"}
DEEP = "[" * 5000 + "]" * 5000  # parses past the interpreter's stack: json.loads recurses
PAST_LIMIT = "[" * 150 + "]" * 150  # parses, but deeper than a body may nest
SURROGATE_ARGS = '{"a": "x\\ud800"}'  # valid JSON text whose value is not valid text


def post(srv, path: str, body: dict | str) -> httpx.Response:
    data = body if isinstance(body, str) else json.dumps(body)
    headers = {"content-type": "application/json"}
    return httpx.post(srv.base_url + path, content=data, headers=headers, timeout=30)


def openai_error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    return err


def ollama_error(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    body = r.json()
    assert set(body) == {"error"}
    return body["error"]


def still_serves(srv) -> None:
    srv.engine.push("ok")
    r = post(srv, CHAT, {"model": "m", "messages": [USER]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"


def _called(arguments: str) -> list[dict]:
    call = {"id": "a", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [USER, {"role": "assistant", "content": "", "tool_calls": [call]}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("arguments", "where"),
    [
        (DEEP, "messages[1].tool_calls[0].function.arguments"),
        (PAST_LIMIT, "messages[1].tool_calls[0].function.arguments"),
        (SURROGATE_ARGS, "messages[1].tool_calls[0].function.arguments.a"),
    ],
)
def test_a_call_s_arguments_text_is_checked_as_a_body_is(scripted, arguments, where, stream):
    body = {"model": "m", "max_tokens": 4, "stream": stream, "messages": _called(arguments)}
    err = openai_error(post(scripted, CHAT, body))
    assert err["param"] == where, err
    # Ollama's chat takes the same messages; its envelope is one string naming the field
    ollama = {"model": "m", "stream": stream, "messages": _called(arguments)}
    assert where in ollama_error(post(scripted, "/api/chat", ollama))
    # a Responses function_call item carries its arguments as text too
    item = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments}
    responses = {"model": "m", "max_output_tokens": 4, "stream": stream, "input": [item]}
    err = openai_error(post(scripted, "/v1/responses", responses))
    assert err["param"] == where.replace("messages[1].tool_calls[0].function", "input[0]")
    still_serves(scripted)


def test_arguments_nested_within_the_limit_are_accepted(scripted):
    scripted.engine.push("x")
    arguments = json.dumps({"a": json.loads("[" * 90 + "]" * 90)})
    r = post(scripted, CHAT, {"model": "m", "messages": _called(arguments)})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"role": ["user"], "content": "x"}, "input[0].role"),
        ({"role": {"a": 1}, "content": "x"}, "input[0].role"),
        ({"role": "user", "content": "x", "id": {"a": 1}}, "input[0].id"),
        ({"type": "function_call_output", "call_id": "c", "output": "4", "id": 7}, "input[0].id"),
    ],
)
def test_a_responses_item_s_role_and_id_must_be_strings(scripted, item, param):
    body = {"model": "m", "max_output_tokens": 4, "store": True, "input": [item]}
    assert openai_error(post(scripted, "/v1/responses", body))["param"] == param
    still_serves(scripted)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("options", "field"),
    [
        ('{"repeat_penalty": -1}', "options.repeat_penalty"),
        ('{"repeat_penalty": 0}', "options.repeat_penalty"),
        ('{"temperature": NaN}', "options.temperature"),
        ('{"top_p": Infinity}', "options.top_p"),
        ('{"presence_penalty": -Infinity}', "options.presence_penalty"),
        ('{"frequency_penalty": NaN}', "options.frequency_penalty"),
    ],
)
def test_ollama_options_the_sampler_cannot_use_are_a_400(scripted, options, field, stream):
    chat = '{"model": "m", "stream": %s, "messages": [{"role": "user", "content": "hi"}], "options": %s}'
    r = post(scripted, "/api/chat", chat % (json.dumps(stream), options))
    assert field in ollama_error(r)
    raw = '{"model": "m", "stream": %s, "raw": true, "prompt": "hi", "options": %s}'
    r = post(scripted, "/api/generate", raw % (json.dumps(stream), options))
    assert field in ollama_error(r)
    still_serves(scripted)


def test_an_ollama_negative_temperature_is_greedy(scripted):
    scripted.engine.push("fine")
    body = {"model": "m", "stream": False, "messages": [USER], "options": {"temperature": -1}}
    r = post(scripted, "/api/chat", body)
    assert r.status_code == 200, r.text
    assert r.json()["message"]["content"] == "fine"
    assert scripted.engine.requests[-1].sampling.temperature == 0.0


@pytest.mark.parametrize(("prompts", "n"), [(16, 5), (65, 1)])
def test_a_completions_batch_larger_than_the_queue_is_a_400(scripted, prompts, n):
    """It could never be queued whole: a 503 with ``retry-after`` would be retried for
    nothing. The scripted server's queue takes 64 (the default --max-queue)."""
    body = {"model": "m", "prompt": [f"p{i}" for i in range(prompts)], "n": n, "max_tokens": 1}
    err = openai_error(post(scripted, "/v1/completions", body))
    assert err["param"] == "prompt" and str(prompts * n) in err["message"], err
    assert "--max-queue" in err["message"]
    still_serves(scripted)


def test_a_completions_batch_the_queue_takes_is_served(scripted):
    for _ in range(8):
        scripted.engine.push("x")
    body = {"model": "m", "prompt": [f"p{i}" for i in range(4)], "n": 2, "max_tokens": 1}
    r = post(scripted, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 8


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#"},
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    ],
)
def test_a_schema_with_no_value_is_a_400_on_every_api(scripted_factory, tiny_tokenizer, schema):
    srv = scripted_factory(constraints=ConstraintCompiler(tiny_tokenizer))
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    err = openai_error(post(srv, CHAT, {"model": "m", "messages": [USER], "response_format": rf}))
    assert err["param"] == "response_format" and "admits no output" in err["message"]
    ollama = {"model": "m", "stream": False, "messages": [USER], "format": schema}
    assert "admits no output" in ollama_error(post(srv, "/api/chat", ollama))
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": schema}}
    body = {"model": "m", "max_output_tokens": 4, "input": "hi", "text": fmt}
    assert "admits no output" in openai_error(post(srv, "/v1/responses", body))["message"]
    msgs = {
        "model": "m",
        "max_tokens": 4,
        "messages": [USER],
        "output_config": {"format": {"type": "json_schema", "schema": schema}},
    }
    r = post(srv, "/v1/messages", msgs)
    assert r.status_code == 400 and "admits no output" in r.json()["error"]["message"], r.text
    # a schema whose value can start is compiled and served as before
    srv.engine.push('"s"')
    fine = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string"}}}
    r = post(srv, CHAT, {"model": "m", "messages": [USER], "response_format": fine})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", {"content": "hello there"}),
        ("/detokenize", {"tokens": [1, 2, 3]}),
    ],
)
def test_the_tokenizer_routes_leave_the_event_loop_free(scripted, path, body):
    """While a tokenizer call is held, another request is answered: the call runs on a
    worker thread. (On the event loop, /health would wait for it and time out.)"""
    # mlx-lm's wrapper hands attribute reads to the Hugging Face tokenizer inside it
    tokenizer = scripted.service.tokenizer._tokenizer
    held, release = threading.Event(), threading.Event()
    name = "encode" if path == "/tokenize" else "decode"
    original = getattr(tokenizer, name)

    def slow(*args, **kwargs):
        held.set()
        assert release.wait(30), "the test never released the tokenizer"
        return original(*args, **kwargs)

    setattr(tokenizer, name, slow)
    try:
        with httpx.Client(timeout=30) as client:
            done: list[httpx.Response] = []
            t = threading.Thread(
                target=lambda: done.append(client.post(scripted.base_url + path, json=body))
            )
            t.start()
            try:
                assert held.wait(30), "the tokenizer was never called"
                health = httpx.get(scripted.base_url + "/health", timeout=5)
                assert health.status_code == 200
            finally:
                release.set()
                t.join(30)
        assert done and done[0].status_code == 200, done
    finally:
        delattr(tokenizer, name)
    assert getattr(tokenizer, name) == original


def test_ollama_raw_generate_enforces_its_format(scripted_factory, tiny_tokenizer):
    """``raw`` skips the template, not the grammar: a format is enforced (a processor on
    the request), and one that cannot be is refused as without ``raw``."""
    srv = scripted_factory(constraints=ConstraintCompiler(tiny_tokenizer))
    raw = {"model": "m", "stream": False, "raw": True, "prompt": "Answer: "}
    srv.engine.push('{"a": 1}')
    r = post(srv, "/api/generate", {**raw, "format": "json"})
    assert r.status_code == 200, r.text
    assert len(srv.engine.requests[-1].logits_processors) == 1
    srv.engine.push("text")
    assert post(srv, "/api/generate", raw).status_code == 200
    assert srv.engine.requests[-1].logits_processors == ()
    assert "cannot enforce" in ollama_error(
        post(srv, "/api/generate", {**raw, "format": {"type": "foo"}})
    )
    assert "admits no output" in ollama_error(
        post(srv, "/api/generate", {**raw, "format": {"$ref": "#"}})
    )


def test_ollama_raw_generate_s_format_shapes_a_real_model_s_text(tiny_server):
    """On a real engine (random weights: the grammar alone makes the text valid)."""
    body = {
        "model": "m",
        "stream": False,
        "raw": True,
        "prompt": "Answer: ",
        "format": {"enum": ["yes", "no"]},
        "options": {"num_predict": 16, "temperature": 1.0, "seed": 3},
    }
    r = httpx.post(tiny_server.base_url + "/api/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["response"]) in ("yes", "no")
    assert r.json()["done_reason"] == "stop"


@pytest.mark.parametrize("value", [True, [], {}, "x", "NaN"])
@pytest.mark.parametrize("path", [CHAT, "/api/chat", "/v1/messages", "/v1/responses"])
def test_a_keep_alive_no_route_can_read_is_one_400_everywhere(scripted, path, value):
    """Even where a single model ignores it: one rule and one message on every route (an
    Ollama body read ``true`` as 1 s, a list as pydantic's two-type complaint)."""
    bodies = {
        CHAT: {"model": "m", "messages": [USER]},
        "/api/chat": {"model": "m", "stream": False, "messages": [USER]},
        "/v1/messages": {"model": "m", "max_tokens": 4, "messages": [USER]},
        "/v1/responses": {"model": "m", "input": "hi"},
    }
    r = post(scripted, path, {**bodies[path], "keep_alive": value})
    assert r.status_code == 400, r.text
    assert "keep_alive must be seconds or a duration" in r.text
    if path == CHAT:
        assert r.json()["error"]["param"] == "keep_alive"


@pytest.mark.parametrize("value", [0, -1, 300, "5m", "1h30m", None])
def test_keep_alive_values_ollama_reads_are_accepted(scripted, value):
    scripted.engine.push("ok")
    body = {"model": "m", "stream": False, "messages": [USER], "keep_alive": value}
    assert post(scripted, "/api/chat", body).status_code == 200
