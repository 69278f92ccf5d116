"""A message needs its content on both APIs (as in OpenAI's and Anthropic's); only an
OpenAI assistant turn that calls tools may leave it out."""

from __future__ import annotations

import httpx
import pytest

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"


def post(srv, path: str, messages: list[dict]) -> httpx.Response:
    body = {"model": "m", "max_tokens": 8, "messages": messages}
    return httpx.post(srv.base_url + path, json=body, timeout=30)


@pytest.mark.parametrize(
    "path,messages,param",
    [
        (CHAT, [{"role": "user"}], "messages[0].content"),
        (CHAT, [{"role": "user", "content": None}], "messages[0].content"),
        (CHAT, [{"role": "system"}, {"role": "user", "content": "u"}], "messages[0].content"),
        (CHAT, [{"role": "developer"}, {"role": "user", "content": "u"}], "messages[0].content"),
        (CHAT, [{"role": "user", "content": "u"}, {"role": "assistant"}], "messages[1].content"),
        (
            CHAT,
            [
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": None, "tool_calls": []},
                {"role": "user", "content": "u"},
            ],
            "messages[1].content",
        ),
        (
            CHAT,
            [
                {"role": "user", "content": "u"},
                {"role": "tool", "tool_call_id": "c1"},
            ],
            "messages[1].content",
        ),
        (MESSAGES, [{"role": "user"}], "messages[0].content"),
        (MESSAGES, [{"role": "user", "content": None}], "messages[0].content: Input should"),
        (
            MESSAGES,
            [{"role": "user", "content": "u"}, {"role": "assistant"}],
            "messages[1].content",
        ),
    ],
)
def test_a_message_without_content_is_a_400(scripted, path, messages, param):
    r = post(scripted, path, messages)
    assert r.status_code == 400, r.text
    body = r.json()
    error = body["error"]
    needle = param if ":" in param else f"{param}: field required"
    assert needle in error["message"]
    if path == CHAT:
        assert error["param"] == needle.split(":")[0]
    else:
        assert body["type"] == "error" and error["type"] == "invalid_request_error"
    assert scripted.engine.requests == []  # nothing reached the engine


def test_an_assistant_turn_with_tool_calls_may_omit_content(scripted):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    scripted.engine.push("done")
    r = post(
        scripted,
        CHAT,
        [
            {"role": "user", "content": "u"},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ],
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "done"
