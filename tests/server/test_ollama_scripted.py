"""Ollama's API through the real server stack, driven by a scripted engine: the official
``ollama`` client and LangChain's ``ChatOllama``, and every answer checked against
tests/specs/ollama-api.schema.json."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest
from clients import wait_until
from ollama_support import (
    CHAT_CHUNK,
    ERROR,
    GENERATE_CHUNK,
    PS,
    SHOW,
    TAGS,
    VERSION,
    ndjson,
)
from payloads import WEATHER

pytestmark = pytest.mark.scripted

TOOLS = [WEATHER]
TOOL_SCRIPT = (
    "<think>",
    "Need",
    " weather",
    "</think>",
    "Checking.",
    "<tool_call>",
    '\n{"name": "get_weather", ',
    '"arguments": {"city": "Paris"}}',
    "\n</tool_call>",
)
USER = [{"role": "user", "content": "hi"}]


def client(srv, **kw) -> ollama.Client:
    return ollama.Client(host=srv.base_url, **kw)


def post(srv, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, timeout=30, **kw)


# ---- chat ----------------------------------------------------------------------------------


def test_chat_whole_and_streamed_carry_the_same_answer(scripted):
    scripted.engine.push("Hello", " world", "!")
    r = post(scripted, "/api/chat", {"model": "m", "messages": USER, "stream": False})
    assert r.status_code == 200, r.text
    body = r.json()
    CHAT_CHUNK.validate(body)
    assert body["message"] == {"role": "assistant", "content": "Hello world!"}
    assert body["done"] is True and body["done_reason"] == "stop" and body["model"] == "m"
    assert body["eval_count"] == 3
    assert body["prompt_eval_count"] == len(scripted.engine.requests[-1].prompt_tokens)
    assert body["total_duration"] >= body["eval_duration"]

    scripted.engine.push("Hello", " world", "!")
    chunks = ndjson(scripted.base_url, "/api/chat", {"model": "m", "messages": USER})
    for c in chunks:
        CHAT_CHUNK.validate(c)
    assert [c["done"] for c in chunks] == [False, False, False, True]
    assert "".join(c["message"]["content"] for c in chunks) == "Hello world!"


def test_the_ollama_client_chats_and_streams(scripted):
    c = client(scripted)
    scripted.engine.push("Hi", " there")
    whole = c.chat(model="m", messages=USER)
    assert whole.message.content == "Hi there" and whole.done_reason == "stop"
    assert whole.eval_count == 2
    scripted.engine.push("Hi", " there")
    parts = list(c.chat(model="m", messages=USER, stream=True))
    assert "".join(p.message.content or "" for p in parts) == "Hi there"
    assert parts[-1].done and not any(p.done for p in parts[:-1])


def test_tool_calls_and_thinking(scripted):
    c = client(scripted)
    scripted.engine.push(*TOOL_SCRIPT)
    whole = c.chat(model="m", messages=USER, tools=TOOLS, think=True)
    assert whole.message.thinking == "Need weather"
    assert whole.message.content == "Checking."
    calls = whole.message.tool_calls
    assert calls is not None and len(calls) == 1
    assert calls[0].function.name == "get_weather"
    assert dict(calls[0].function.arguments) == {"city": "Paris"}
    assert scripted.engine.requests[-1].prompt_tokens  # the tools reached the template
    assert scripted.service.render  # same service
    scripted.engine.push(*TOOL_SCRIPT)
    body = {"model": "m", "messages": USER, "tools": TOOLS}
    chunks = ndjson(scripted.base_url, "/api/chat", body)
    for ch in chunks:
        CHAT_CHUNK.validate(ch)
    streamed = [tc for ch in chunks for tc in ch["message"].get("tool_calls", [])]
    assert [tc["function"]["arguments"] for tc in streamed] == [{"city": "Paris"}]


def test_a_tool_result_conversation_renders(scripted):
    """An assistant turn with tool_calls (arguments as an object) and a tool turn."""
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
        },
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
    ]
    scripted.engine.push("ok")
    r = client(scripted).chat(model="m", messages=messages, tools=TOOLS)
    assert r.message.content == "ok"
    prompt = scripted.service.tokenizer.decode(scripted.engine.requests[-1].prompt_tokens)
    assert "sunny" in prompt and "Oslo" in prompt


def test_options_reach_the_engine(scripted):
    scripted.engine.push("a", "b", "c", "d")
    options = {
        "temperature": 0.3,
        "top_p": 0.5,
        "top_k": 7,
        "min_p": 0.05,
        "repeat_penalty": 1.2,
        "seed": 11,
        "num_predict": 2,
        "stop": ["zz"],
        "num_ctx": 4096,
        "num_gpu": 1,
    }
    r = client(scripted).chat(model="m", messages=USER, options=options)
    req = scripted.engine.requests[-1]
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.3, 0.5, 7, 0.05)
    assert s.repetition_penalty == 1.2 and s.seed == 11
    assert req.max_tokens == 2 and req.stop == ("zz",)
    assert r.message.content == "ab" and r.done_reason == "length"


def test_ollama_defaults_without_options(scripted):
    scripted.engine.push("x")
    client(scripted).chat(model="m", messages=USER)
    s = scripted.engine.requests[-1].sampling
    assert (s.temperature, s.top_p, s.top_k) == (0.8, 0.9, 40)


def test_format_asks_for_a_constraint(scripted):
    """The scripted server has no grammar engine: a format is refused, in Ollama's shape
    (the grammar itself is tested on a real model in test_ollama_process.py)."""
    r = post(scripted, "/api/chat", {"model": "m", "messages": USER, "format": "json"})
    assert r.status_code == 400
    ERROR.validate(r.json())
    assert "structured output" in r.json()["error"]


def test_an_empty_chat_loads_the_model(scripted):
    r = post(scripted, "/api/chat", {"model": "m", "messages": []})
    assert r.status_code == 200
    assert r.json()["done_reason"] == "load" and r.json()["done"] is True
    r = post(scripted, "/api/generate", {"model": "m", "keep_alive": 0})
    assert r.json()["done_reason"] == "unload"
    assert not scripted.engine.requests


# ---- generate ------------------------------------------------------------------------------


def test_generate_templated_and_raw(scripted):
    c = client(scripted)
    scripted.engine.push("Blue", ".")
    r = c.generate(model="m", prompt="Why is the sky blue?", system="Be brief")
    assert r.response == "Blue." and r.done_reason == "stop"
    prompt = scripted.service.tokenizer.decode(scripted.engine.requests[-1].prompt_tokens)
    assert "Be brief" in prompt and "Why is the sky blue?" in prompt
    assert prompt != "Why is the sky blue?"  # through the chat template

    scripted.engine.push("raw", " text")
    chunks = ndjson(
        scripted.base_url, "/api/generate", {"model": "m", "prompt": "abc", "raw": True}
    )
    for ch in chunks:
        GENERATE_CHUNK.validate(ch)
    assert "".join(ch["response"] for ch in chunks) == "raw text"
    raw_prompt = scripted.engine.requests[-1].prompt_tokens
    assert scripted.service.tokenizer.decode(raw_prompt) == "abc"


def test_generate_reasoning_goes_to_thinking(scripted):
    scripted.engine.push("<think>", "hmm", "</think>", "42")
    r = client(scripted).generate(model="m", prompt="q", think=True)
    assert r.thinking == "hmm" and r.response == "42"


# ---- models ------------------------------------------------------------------------------


def test_tags_show_ps_version(scripted):
    c = client(scripted)
    tags = httpx.get(scripted.base_url + "/api/tags").json()
    TAGS.validate(tags)
    assert [m["name"] for m in tags["models"]] == ["scripted-model"]
    assert [m.model for m in c.list().models] == ["scripted-model"]

    ps = httpx.get(scripted.base_url + "/api/ps").json()
    PS.validate(ps)
    assert ps["models"][0]["context_length"] == 512
    assert c.ps().models[0].model == "scripted-model"

    show = post(scripted, "/api/show", {"model": "scripted-model"}).json()
    SHOW.validate(show)
    assert show["template"] == scripted.service.template
    assert "completion" in show["capabilities"] and "tools" in show["capabilities"]
    info = show["model_info"]
    assert info[f"{info['general.architecture']}.context_length"] == 512
    assert c.show("scripted-model").modelinfo is not None

    VERSION.validate(httpx.get(scripted.base_url + "/api/version").json())


@pytest.mark.parametrize("path", ["/api/pull", "/api/delete", "/api/create"])
def test_model_management_says_what_to_do_instead(scripted, path):
    r = httpx.request(
        "DELETE" if path == "/api/delete" else "POST",
        scripted.base_url + path,
        json={"model": "llama3"},
    )
    assert r.status_code == 400
    ERROR.validate(r.json())
    assert "--model" in r.json()["error"]


# ---- errors, auth, cancellation ------------------------------------------------------------


def test_a_min_p_outside_zero_to_one_is_refused_in_ollamas_shape(scripted):
    """min_p is a fraction of the likeliest token's probability: 1.5 would fail the sampler
    (a 500 from a request's own setting); it is refused as /v1 refuses it, naming it."""
    body = {"model": "m", "messages": USER, "options": {"min_p": 1.5}}
    r = post(scripted, "/api/chat", body)
    assert r.status_code == 400 and "min_p" in r.json()["error"], r.text
    ERROR.validate(r.json())
    body["options"] = {"min_p": 0.05}
    assert post(scripted, "/api/chat", {**body, "stream": False}).status_code == 200


def test_errors_are_ollamas_shape(scripted):
    for body in ({"messages": USER}, {"model": "m", "messages": [{"role": "x", "content": ""}]}):
        r = post(scripted, "/api/chat", body)
        assert r.status_code == 400, r.text
        ERROR.validate(r.json())
    r = httpx.get(scripted.base_url + "/api/nothing")
    assert r.status_code == 404
    ERROR.validate(r.json())
    r = post(scripted, "/api/embed", {"model": "m", "input": "x"})
    assert r.status_code == 400 and "chat model" in r.json()["error"]
    with pytest.raises(ollama.ResponseError) as e:
        client(scripted).chat(model="m", messages=[{"role": "x", "content": "a"}])
    assert e.value.status_code == 400


def test_api_key_applies(scripted_factory):
    srv = scripted_factory(api_key="k")
    r = httpx.get(srv.base_url + "/api/tags")
    assert r.status_code == 401
    ERROR.validate(r.json())
    srv.engine.push("ok")
    c = client(srv, headers={"Authorization": "Bearer k"})
    assert c.chat(model="m", messages=USER).message.content == "ok"


def test_failure_after_the_stream_began_is_an_error_line(scripted):
    scripted.engine.push("Hello", finish="error")
    with httpx.stream(
        "POST", scripted.base_url + "/api/chat", json={"model": "m", "messages": USER}, timeout=30
    ) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[0]["message"]["content"] == "Hello"
    ERROR.validate(lines[-1])
    with pytest.raises(ollama.ResponseError):
        scripted.engine.push("Hello", finish="error")
        list(client(scripted).chat(model="m", messages=USER, stream=True))


def test_client_disconnect_frees_the_slot(scripted):
    scripted.engine.push(*["tok"] * 400, delay=0.1)  # 40 s if nobody stopped it
    body = {"model": "m", "messages": USER}
    with httpx.stream("POST", scripted.base_url + "/api/chat", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if "tok" in line:
                break
        assert scripted.engine.active_count == 1
    assert wait_until(lambda: httpx.get(scripted.base_url + "/health").json()["active"] == 0)


def test_a_silent_stream_gets_empty_chunks(scripted_factory):
    srv = scripted_factory(app_kw={"keepalive_s": 0.05})
    srv.engine.push("", "Hi", delay=0.5)
    chunks = ndjson(srv.base_url, "/api/chat", {"model": "m", "messages": USER})
    for ch in chunks:
        CHAT_CHUNK.validate(ch)
    empty = [ch for ch in chunks if not ch["done"] and ch["message"]["content"] == ""]
    assert len(empty) >= 2
    assert "".join(ch["message"]["content"] for ch in chunks) == "Hi"


# ---- LangChain -----------------------------------------------------------------------------


def test_langchain_chat_ollama(scripted):
    from langchain_ollama import ChatOllama

    llm = ChatOllama(model="m", base_url=scripted.base_url, num_predict=8)
    scripted.engine.push("Bonjour", "!")
    assert llm.invoke("hi").content == "Bonjour!"
    scripted.engine.push("Bon", "jour")
    assert "".join(str(ch.content) for ch in llm.stream("hi")) == "Bonjour"
    scripted.engine.push(*TOOL_SCRIPT)
    out = llm.bind_tools(TOOLS).invoke("weather in Paris?")
    assert [(c["name"], c["args"]) for c in out.tool_calls] == [("get_weather", {"city": "Paris"})]


# ---- plumbing shared with /v1 ----------------------------------------------------------------


def test_browser_guard_and_metrics_apply(scripted_factory):
    srv = scripted_factory(api_key="k")
    key = {"Authorization": "Bearer k"}
    body = {"model": "m", "messages": USER, "stream": False}
    r = httpx.post(
        srv.base_url + "/api/chat", json=body, headers={**key, "Origin": "https://evil.example"}
    )
    assert r.status_code == 403
    ERROR.validate(r.json())
    assert srv.engine.requests == []
    srv.engine.push("a", "b")
    assert httpx.post(srv.base_url + "/api/chat", json=body, headers=key).status_code == 200
    metrics = httpx.get(srv.base_url + "/metrics", headers=key).text
    line = 'mlx_server_requests_total{method="POST",route="/api/chat",status="200"} 1.0'
    assert line in metrics
    assert "mlx_server_generation_tokens_total 2.0" in metrics


def test_refusals_in_ollamas_shape(scripted):
    long = {"role": "user", "content": "word " * 600}  # over the 512-token context
    r = post(scripted, "/api/chat", {"model": "m", "messages": [long]})
    assert r.status_code == 400
    ERROR.validate(r.json())
    assert "context" in r.json()["error"]
    r = post(scripted, "/api/generate", {"model": "m", "prompt": "def f(", "suffix": "pass"})
    assert r.status_code == 400  # the tiny model has no fill-in-the-middle tokens
    ERROR.validate(r.json())
    r = post(scripted, "/api/chat", {"model": "m", "messages": USER, "options": {"top_k": "x"}})
    assert r.status_code == 400 and "options.top_k" in r.json()["error"]
    images = {"role": "user", "content": "?", "images": ["iVBORw0KGgo="]}
    r = post(scripted, "/api/chat", {"model": "m", "messages": [images]})
    assert r.status_code == 400 and "text only" in r.json()["error"]


def test_unknown_fields_are_named_in_the_header(scripted):
    scripted.engine.push("ok")
    body = {"model": "m", "messages": USER, "stream": False, "frobnicate": 1}
    r = post(scripted, "/api/chat", body)
    assert r.status_code == 200
    assert r.headers["x-mlx-server-ignored-fields"] == "frobnicate"
