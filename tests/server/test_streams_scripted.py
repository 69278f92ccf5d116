"""What every streaming API shares: keep-alive frames while the first token is awaited, and
a failure after the stream began, as the protocol's own error event and as the Swift
mlx-server's ``error:`` line that Jan's stream reader acts on. Standard SDKs (strict) read
the same streams unharmed."""

from __future__ import annotations

import json
import threading

import anthropic
import httpx
import openai
import pytest
from clients import anthropic_client, openai_client

CHAT = ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "a"}]})
COMPLETIONS = ("/v1/completions", {"model": "m", "prompt": "a", "max_tokens": 8})
MESSAGES = (
    "/v1/messages",
    {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "a"}]},
)
RESPONSES = ("/v1/responses", {"model": "m", "input": "a"})
APIS = {"chat": CHAT, "completions": COMPLETIONS, "messages": MESSAGES, "responses": RESPONSES}

# The keep-alive line of each API, and how many of them the stream sends unasked at its
# start (Anthropic's message_start is followed by a ping).
KEEPALIVE = {"chat": ": keep-alive", "completions": ": keep-alive", "responses": ": keep-alive"}
KEEPALIVE["messages"] = "event: ping"
OPENING_PINGS = {"messages": 1}


@pytest.fixture
def fast_keepalive(scripted_factory):
    return scripted_factory(app_kw={"keepalive_s": 0.05})


def text_of(api: str, data: dict) -> str:
    """The generated text a stream event carries, in each API's shape."""
    if api == "chat":
        return "".join(c["delta"].get("content") or "" for c in data.get("choices", []))
    if api == "completions":
        return "".join(c["text"] for c in data.get("choices", []))
    if api == "messages":
        return (
            data.get("delta", {}).get("text", "") if data["type"] == "content_block_delta" else ""
        )
    return data.get("delta", "") if data["type"] == "response.output_text.delta" else ""


@pytest.mark.parametrize("api", APIS)
def test_keep_alive_while_the_first_token_is_awaited(fast_keepalive, api):
    """The engine holds its first token until the client has seen a keep-alive frame."""
    path, body = APIS[api]
    gate = threading.Event()
    fast_keepalive.engine.push("Hi", " there", gate=gate)
    opening = OPENING_PINGS.get(api, 0)
    seen, text_before, text = 0, "", ""
    with httpx.stream(
        "POST", fast_keepalive.base_url + path, json={**body, "stream": True}, timeout=30
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line == KEEPALIVE[api]:
                seen += 1
                if seen == opening + 1:
                    text_before = text
                    gate.set()
            elif line.startswith("data: {"):
                text += text_of(api, json.loads(line[6:]))
    assert gate.is_set(), "no keep-alive frame came while the first token was awaited"
    assert text_before == "" and text == "Hi there"


class JanStreamError(Exception):
    pass


def read_like_jan(srv, path: str, body: dict) -> list[dict]:
    """Read a stream as Jan's extension does: split the bytes on newlines, parse each
    ``data: `` line (but ``[DONE]``) as JSON, throw the message of an ``error: `` line."""
    chunks: list[dict] = []
    with httpx.stream("POST", srv.base_url + path, json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        buffer = ""
        for text in r.iter_text():
            buffer += text
            *lines, buffer = buffer.split("\n")
            for line in lines:
                if line.startswith("error: "):
                    raise JanStreamError(json.loads(line[len("error: ") :])["message"])
                if line.startswith("data: ") and line.strip() != "data: [DONE]":
                    chunks.append(json.loads(line[len("data: ") :]))
    return chunks


@pytest.mark.parametrize("api", APIS)
def test_jan_reader_sees_a_mid_stream_failure(scripted, api):
    path, body = APIS[api]
    scripted.engine.push("partial", finish="error")
    with pytest.raises(JanStreamError, match="scripted failure"):
        read_like_jan(scripted, path, body)
    scripted.engine.push("fine")  # the server goes on
    chunks = read_like_jan(scripted, path, body)
    assert "".join(text_of(api, c) for c in chunks) == "fine"


@pytest.mark.parametrize("api", APIS)
def test_the_protocols_own_error_event_follows_jans_line(scripted, api):
    path, body = APIS[api]
    scripted.engine.push("partial", finish="error")
    with httpx.stream(
        "POST", scripted.base_url + path, json={**body, "stream": True}, timeout=30
    ) as resp:
        lines = [x for x in resp.iter_lines() if x]
    jan = next(i for i, x in enumerate(lines) if x.startswith("error: "))
    after = [json.loads(x[6:]) for x in lines[jan:] if x.startswith("data: ")]
    if api in ("chat", "completions"):
        assert after == [{"error": {**after[0]["error"], "message": "scripted failure"}}]
    elif api == "messages":
        assert after[0]["type"] == "error" and after[0]["error"]["type"] == "api_error"
    else:
        assert after[-1]["type"] == "response.failed"
        assert after[-1]["response"]["error"]["message"] == "scripted failure"
    assert "data: [DONE]" not in lines


def test_sdks_read_keep_alives_and_ignore_jans_line(fast_keepalive):
    """Comment lines, pings and the ``error:`` field pass through the official SDKs: a
    failure surfaces as the protocol's own error."""
    srv = fast_keepalive
    oa, an = openai_client(srv), anthropic_client(srv)
    messages = CHAT[1]["messages"]

    gate = threading.Event()
    srv.engine.push("Hi", gate=gate)
    stream = oa.chat.completions.create(model="m", messages=messages, stream=True)
    gate.set()
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "Hi"

    srv.engine.push("partial", finish="error")
    with pytest.raises(openai.APIError, match="scripted failure"):
        list(oa.chat.completions.create(model="m", messages=messages, stream=True))
    srv.engine.push("partial", finish="error")
    with pytest.raises(openai.APIError, match="scripted failure"):
        # Not strict: the SDK's Completion type has no null finish_reason for a stream's chunks.
        legacy = openai_client(srv, strict=False).completions
        list(legacy.create(model="m", prompt="a", max_tokens=8, stream=True))
    srv.engine.push("partial", finish="error")
    events = list(oa.responses.create(model="m", input="a", stream=True))
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.message == "scripted failure"

    srv.engine.push("partial", finish="error")
    with pytest.raises(anthropic.APIStatusError, match="scripted failure"):
        list(an.messages.create(model="m", max_tokens=8, messages=messages, stream=True))
    gate = threading.Event()
    srv.engine.push("Hi", gate=gate)
    with an.messages.stream(model="m", max_tokens=8, messages=messages) as s:
        gate.set()
        assert s.get_final_text() == "Hi"


def test_a_queued_anthropic_stream_gets_comments_until_message_start(fast_keepalive):
    """message_start (which reports the prompt's cache split) waits for the engine to take
    the request up; until then the keep-alive is a comment line, so the first event is
    still message_start, then pings as the spec shows them."""
    path, body = MESSAGES
    start_gate = threading.Event()
    fast_keepalive.engine.push("Hi", start_gate=start_gate)
    before_start: list[str] = []
    names: list[str] = []
    with httpx.stream(
        "POST", fast_keepalive.base_url + path, json={**body, "stream": True}, timeout=30
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not names and line:
                before_start.append(line)
                if line == ": keep-alive":
                    start_gate.set()
            if line.startswith("event: "):
                names.append(line[len("event: ") :])
    assert start_gate.is_set() and set(before_start) == {": keep-alive", "event: message_start"}
    assert names[0] == "message_start" and names[-1] == "message_stop"
