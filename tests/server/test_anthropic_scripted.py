"""Anthropic Messages API through the real server stack, driven by a scripted engine."""

from __future__ import annotations

import json
import threading

import anthropic
import httpx
import pytest
from clients import anthropic_client, wait_until
from payloads import TIME, WEATHER, anthropic_tool, anthropic_tool_round_trip
from support import (
    COUNT,
    ERROR,
    MESSAGE,
    check_event,
    check_stream_order,
    stream_events,
)

TOOLS = [anthropic_tool(WEATHER), anthropic_tool(TIME)]

# Thinking, text, then two tool calls; the first call's JSON arrives in several pieces.
TOOL_SCRIPT = (
    "<think>",
    "Need",
    " both",
    "</think>",
    "Checking",
    " now.",
    "<tool_call>",
    '\n{"name": "get_weather", ',
    '"arguments": {"city": ',
    '"Paris"}}',
    "\n</tool_call>",
    "<tool_call>",
    '\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
)


def post(srv, body: dict, path: str = "/v1/messages", **kw) -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, timeout=30, **kw)


def user(text: str = "hi") -> list[dict]:
    return [{"role": "user", "content": text}]


def base(**kw) -> dict:
    return {"model": "claude-test", "max_tokens": 64, "messages": user(), **kw}


def error_of(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    if kind in ("request_too_large",):  # documented by Anthropic, absent from the schema
        assert body["type"] == "error"
    else:
        ERROR.validate(body)
    assert body["error"]["type"] == kind
    return body["error"]["message"]


# ---- responses ---------------------------------------------------------------------------


def test_non_stream_message_is_valid(scripted):
    scripted.engine.push("Hello", " world", "!")
    r = post(scripted, base())
    assert r.status_code == 200, r.text
    body = r.json()
    MESSAGE.validate(body)
    assert body["id"].startswith("msg_")
    assert body["type"] == "message" and body["role"] == "assistant"
    assert body["model"] == "claude-test"
    assert body["content"] == [{"type": "text", "text": "Hello world!", "citations": None}]
    assert body["stop_reason"] == "end_turn" and body["stop_sequence"] is None
    usage = body["usage"]
    assert usage["output_tokens"] == 3
    assert usage["input_tokens"] == len(scripted.engine.requests[-1].prompt_tokens)
    assert usage["cache_read_input_tokens"] == 0 and usage["cache_creation_input_tokens"] == 0

    scripted.engine.push("Hi", "!")
    msg = anthropic_client(scripted).messages.create(model="m", max_tokens=10, messages=user())
    assert msg.content[0].type == "text" and msg.content[0].text == "Hi!"
    assert msg.stop_reason == "end_turn" and msg.usage.output_tokens == 2


def test_stream_accumulates_to_the_non_stream_message(scripted):
    c = anthropic_client(scripted)
    kw = dict(model="m", max_tokens=64, messages=user("weather?"), tools=TOOLS)
    scripted.engine.push(*TOOL_SCRIPT)
    whole = c.messages.create(**kw)
    scripted.engine.push(*TOOL_SCRIPT)
    with c.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    a = whole.model_dump(exclude={"id"})
    b = streamed.model_dump(exclude={"id"})
    for m in (a, b):  # call ids are fresh per response
        for block in m["content"]:
            block.pop("id", None)
    assert a == b
    assert [blk.type for blk in whole.content] == ["thinking", "text", "tool_use", "tool_use"]


def test_stream_thinking_text_and_two_tool_calls(scripted):
    scripted.engine.push(*TOOL_SCRIPT)
    events = stream_events(scripted, base(messages=user("weather?"), tools=TOOLS))
    check_stream_order(events)
    starts = [d for n, d in events if n == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == [
        "thinking",
        "text",
        "tool_use",
        "tool_use",
    ]
    assert starts[0]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    for s in starts[2:]:
        assert s["content_block"]["input"] == {}
        assert s["content_block"]["id"].startswith("toolu_")
    assert starts[2]["content_block"]["id"] != starts[3]["content_block"]["id"]
    assert [s["content_block"]["name"] for s in starts[2:]] == ["get_weather", "get_time"]

    def deltas(i: int) -> list[dict]:
        return [d["delta"] for n, d in events if n == "content_block_delta" and d["index"] == i]

    thinking = deltas(0)
    assert [d["type"] for d in thinking] == ["thinking_delta"] * 2 + ["signature_delta"]
    assert "".join(d["thinking"] for d in thinking[:-1]) == "Need both"
    assert thinking[-1]["signature"]
    assert "".join(d["text"] for d in deltas(1)) == "Checking now."
    first = deltas(2)
    assert {d["type"] for d in first} == {"input_json_delta"}
    assert len(first) >= 2  # streamed as the JSON arrived, not in one piece at the end
    assert json.loads("".join(d["partial_json"] for d in first)) == {"city": "Paris"}
    assert json.loads("".join(d["partial_json"] for d in deltas(3))) == {"tz": "CET"}
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "tool_use"
    assert delta["usage"]["output_tokens"] == len(TOOL_SCRIPT)

    # The SDK's own accumulation of the same stream.
    scripted.engine.push(*TOOL_SCRIPT)
    with anthropic_client(scripted).messages.stream(
        model="m", max_tokens=64, messages=user("weather?"), tools=TOOLS
    ) as stream:
        msg = stream.get_final_message()
    assert msg.content[0].thinking == "Need both"
    assert msg.content[2].input == {"city": "Paris"} and msg.content[3].input == {"tz": "CET"}
    assert msg.stop_reason == "tool_use"


def test_empty_answer_has_no_blocks(scripted):
    scripted.engine.push()
    r = post(scripted, base())
    MESSAGE.validate(r.json())
    assert r.json()["content"] == [] and r.json()["stop_reason"] == "end_turn"
    scripted.engine.push()
    events = stream_events(scripted, base())
    assert [n for n, _ in events] == ["message_start", "ping", "message_delta", "message_stop"]


def test_max_tokens_stop_reason(scripted):
    scripted.engine.push("a", "b", "c", "d", "e")
    body = post(scripted, base(max_tokens=2)).json()
    MESSAGE.validate(body)
    assert body["stop_reason"] == "max_tokens" and body["usage"]["output_tokens"] == 2
    assert body["content"][0]["text"] == "ab"


def test_stop_sequences_are_enforced(scripted):
    c = anthropic_client(scripted)
    scripted.engine.push("Hello", " wor", "ld EN", "D more", " text")
    msg = c.messages.create(
        model="m", max_tokens=20, messages=user(), stop_sequences=["END", "never"]
    )
    assert scripted.engine.requests[-1].stop == ("END", "never")
    assert msg.content[0].text == "Hello world "
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "END"

    scripted.engine.push("Hello", " wor", "ld EN", "D more", " text")
    events = stream_events(scripted, base(stop_sequences=["END"]))
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == "Hello world "
    assert events[-2][1]["delta"] == {
        "stop_reason": "stop_sequence",
        "stop_sequence": "END",
        "stop_details": None,
        "container": None,
    }


def test_sampling_defaults_and_values_reach_the_engine(scripted):
    post(scripted, base())
    s = scripted.engine.requests[-1].sampling
    assert s.temperature == 1.0 and s.top_p == 1.0 and s.top_k == 0  # Anthropic's defaults
    post(scripted, base(temperature=0.2, top_p=0.9, top_k=40, metadata={"user_id": "u"}))
    s = scripted.engine.requests[-1].sampling
    assert (s.temperature, s.top_p, s.top_k) == (0.2, 0.9, 40)
    assert scripted.engine.requests[-1].max_tokens == 64


# ---- what reaches the template -----------------------------------------------------------


def claude_code_body(cch: str) -> dict:
    """A request shaped like Claude Code's: billing line, cache_control, tools, a tool turn."""
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": 32,
        "stream": True,
        "metadata": {"user_id": "user_abc_account__session_1"},
        "system": [
            {
                "type": "text",
                "text": f"x-anthropic-billing-header: cc_version=2.1.117.48f; cc_entrypoint=cli; cch={cch};",
            },
            {
                "type": "text",
                "text": "You are Claude Code, a CLI for coding.",
                "cache_control": {"type": "ephemeral"},
            },
            {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
        ],
        "tools": [
            {
                "name": "Read",
                "description": "Read a file",
                "input_schema": {
                    "type": "object",
                    "properties": {"file_path": {"type": "string"}},
                    "required": ["file_path"],
                },
            },
            {
                "name": "Bash",
                "description": "Run a command",
                "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
                "cache_control": {"type": "ephemeral"},
            },
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                    {"type": "text", "text": "Show a.py", "cache_control": {"type": "ephemeral"}},
                ],
            },
            *anthropic_tool_round_trip(
                "Read",
                {"file_path": "a.py"},
                [{"type": "text", "text": "print(1)"}],
                call_id="toolu_01A",
                before=(
                    {"type": "thinking", "thinking": "Read it.", "signature": "c2ln"},
                    {"type": "text", "text": "Reading."},
                ),
                after=({"type": "text", "text": "Explain it."},),
            ),
        ],
    }


def test_claude_code_request_reaches_the_template(scripted_factory):
    scripted = scripted_factory(ctx_size=4096)  # the tiny tokenizer spends many tokens
    scripted.engine.push("It prints 1.")
    # Claude Code posts to /v1/messages?beta=true with its beta headers.
    headers = {
        "anthropic-beta": "interleaved-thinking-2025-05-14",
        "anthropic-version": "2023-06-01",
    }
    events = stream_events(
        scripted, claude_code_body("eb6c6"), path="/v1/messages?beta=true", headers=headers
    )
    text = "".join(d["delta"].get("text", "") for n, d in events if n == "content_block_delta")
    assert text == "It prints 1."
    first = scripted.engine.requests[-1].prompt_tokens
    prompt = scripted.service.tokenizer.decode(first)
    assert "billing-header" not in prompt and "cch=" not in prompt
    assert prompt.startswith(
        "<|im_start|>system\nYou are Claude Code, a CLI for coding.\nBe brief.<|im_end|>"
    )
    expected_turns = [
        "<|im_start|>user\n<system-reminder>ctx</system-reminder>\nShow a.py<|im_end|>",
        '<|im_start|>assistant\nReading.<tool_call>\n{"name": "Read", "arguments": {"file_path": "a.py"}}\n</tool_call><|im_end|>',
        "<|im_start|>tool\nprint(1)<|im_end|>",
        "<|im_start|>user\nExplain it.<|im_end|>",
    ]
    pos = [prompt.index(t) for t in expected_turns]
    assert pos == sorted(pos)  # the tool result comes before the text that followed it
    assert '"name": "Read"' in prompt and '"name": "Bash"' in prompt  # tools rendered
    assert "cache_control" not in prompt and "ephemeral" not in prompt

    # A new cch value must not change a single prompt token (prefix caching depends on it).
    scripted.engine.push("ok")
    stream_events(scripted, claude_code_body("0aaa9"))
    assert scripted.engine.requests[-1].prompt_tokens == first


# What Claude Code 2.1 sends along with the conversation.
CLAUDE_CODE_BETAS = (
    "claude-code-20250219,context-1m-2025-08-07,interleaved-thinking-2025-05-14,"
    "thinking-token-count-2026-05-13,context-management-2025-06-27,"
    "prompt-caching-scope-2026-01-05,mid-conversation-system-2026-04-07,effort-2025-11-24"
)
CLAUDE_CODE_HEADERS = {
    "anthropic-beta": CLAUDE_CODE_BETAS,
    "anthropic-version": "2023-06-01",
    "anthropic-dangerous-direct-browser-access": "true",
    "x-app": "cli",
    "x-claude-code-session-id": "558845ef-92bd-437d-8aab-7587c29bd1e2",
}


def test_claude_code_2_1_request_with_a_system_message_in_place(scripted_factory):
    scripted = scripted_factory(ctx_size=4096)
    body = claude_code_body("7a9")
    body["messages"].insert(1, {"role": "system", "content": "Agent types: Explore, Plan."})
    body.update(
        thinking={"type": "adaptive"},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        output_config={"effort": "high"},
    )
    count = post(
        scripted,
        {k: body[k] for k in ("model", "system", "messages", "tools", "thinking")}
        | {"context_management": body["context_management"], "output_config": {"effort": "high"}},
        path="/v1/messages/count_tokens?beta=true",
        headers=CLAUDE_CODE_HEADERS,
    )
    assert count.status_code == 200, count.text
    COUNT.validate(count.json())
    scripted.engine.push("It prints 1.")
    events = stream_events(
        scripted, body, path="/v1/messages?beta=true", headers=CLAUDE_CODE_HEADERS
    )
    check_stream_order(events)
    usage = events[0][1]["message"]["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == count.json()["input_tokens"]
    prompt = scripted.service.tokenizer.decode(scripted.engine.requests[-1].prompt_tokens)
    turns = [
        "<|im_start|>user\n<system-reminder>ctx</system-reminder>\nShow a.py<|im_end|>",
        "<|im_start|>system\nAgent types: Explore, Plan.<|im_end|>",
        "<|im_start|>assistant\nReading.",
    ]
    pos = [prompt.index(t) for t in turns]
    assert pos == sorted(pos)
    # Without ?beta=true, and non-streaming, the same request is answered the same way.
    scripted.engine.push("It prints 1.")
    r = post(scripted, {**body, "stream": False}, headers=CLAUDE_CODE_HEADERS)
    assert r.status_code == 200, r.text
    MESSAGE.validate(r.json())
    assert [(b["type"], b["text"]) for b in r.json()["content"]] == [("text", "It prints 1.")]


def test_count_tokens_equals_input_tokens(scripted):
    c = anthropic_client(scripted)
    kw = dict(
        model="m",
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "weather in Paris?"}]}],
        tools=TOOLS,
        thinking={"type": "enabled", "budget_tokens": 2048},
    )
    counted = c.messages.count_tokens(**kw)
    raw = post(scripted, kw, path="/v1/messages/count_tokens").json()
    COUNT.validate(raw)
    assert raw == {"input_tokens": counted.input_tokens}
    scripted.engine.push("Sunny.")
    msg = c.messages.create(max_tokens=32, **kw)
    assert msg.usage.input_tokens == counted.input_tokens
    assert len(scripted.engine.requests[-1].prompt_tokens) == counted.input_tokens
    without_tools = c.messages.count_tokens(**{**kw, "tools": []})
    assert without_tools.input_tokens < counted.input_tokens  # tools are counted
    scripted.engine.push("Sunny.")
    events = stream_events(scripted, {**kw, "max_tokens": 32})
    assert events[0][1]["message"]["usage"]["input_tokens"] == counted.input_tokens


# ---- errors ------------------------------------------------------------------------------

BAD_REQUESTS = [
    ({"model": "m", "messages": user()}, "max_tokens"),
    ({"model": "m", "max_tokens": 5}, "messages"),
    ({"max_tokens": 5, "messages": user()}, "model"),
    (base(messages=[]), "messages"),
    (base(max_tokens=0), "max_tokens"),
    (base(messages=[{"role": "system", "content": "x"}]), "messages: at least one"),
    (base(messages=[{"role": "developer", "content": "x"}]), "messages[0].role"),
    (base(messages=[{"role": "user"}]), "messages[0].content: field required"),
    (base(messages=[*user(), {"role": "system"}]), "messages[1].content: field required"),
    (
        base(messages=[*user(), {"role": "system", "content": [{"type": "image"}]}]),
        "messages[1].content[0]",
    ),
    (
        base(
            messages=[
                *user(),
                {
                    "role": "system",
                    "content": [
                        {"type": "text", "text": "a"},
                        {"type": "thinking", "thinking": "b"},
                    ],
                },
            ]
        ),
        "messages[1].content[1]: a system message may hold text blocks only",
    ),
    (base(temperature=1.5), "temperature"),
    (base(top_k=-1), "top_k"),
    (base(stream="yes"), "stream"),
    (base(system=[{"type": "image", "text": "x"}]), "system"),
    (base(messages=[{"role": "user", "content": [{"type": "video"}]}]), "messages[0].content[0]"),
    (base(messages=[{"role": "user", "content": [{"type": "text"}]}]), "content[0].text"),
    (base(messages=[{"role": "user", "content": ["hi"]}]), "messages[0].content[0]"),
    (
        base(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                        }
                    ],
                }
            ]
        ),
        "messages[0].content[0]",
    ),
    (
        base(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                }
            ]
        ),
        "messages[0].content[0]",
    ),
    (
        base(messages=[{"role": "assistant", "content": [{"type": "tool_result"}]}]),
        "tool_use_id",
    ),
    (
        base(
            messages=[
                {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}
            ]
        ),
        "messages[0].content[0]",
    ),
    (
        base(
            messages=[
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}
            ]
        ),
        "content[0].input",
    ),
    (base(tools=[{"name": "f"}]), "tools[0].input_schema"),
    (base(tools=[{"description": "no name", "input_schema": {}}]), "tools"),
    (base(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0]"),
    (base(tools=TOOLS + TOOLS[:1]), "tools[2].name"),
    (base(tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}), "tool_choice.name"),
    (base(tool_choice={"type": "any"}), "tool_choice"),
    (base(tool_choice={"type": "sometimes"}), "tool_choice"),
    (base(thinking={"type": "enabled", "budget_tokens": 10}), "budget_tokens"),
    (base(thinking={"type": "maybe"}), "thinking"),
    (base(output_config={"format": {"type": "xml"}}), "output_config.format"),
    (base(max_tokens=100_000), "context"),
]


@pytest.mark.parametrize("body,names", BAD_REQUESTS, ids=[n for _, n in BAD_REQUESTS])
def test_bad_request_gets_the_anthropic_envelope(scripted, body, names):
    message = error_of(post(scripted, body), 400, "invalid_request_error")
    assert names in message
    scripted.engine.push("fine")
    assert post(scripted, base()).json()["content"][0]["text"] == "fine"  # still serving


def test_context_overflow_uses_anthropics_wording(scripted):
    """Claude Code recognises these two messages (and compacts / lowers max_tokens)."""
    counted = (
        anthropic_client(scripted).messages.count_tokens(model="m", messages=user()).input_tokens
    )
    message = error_of(post(scripted, base(max_tokens=1000)), 400, "invalid_request_error")
    assert message.startswith(
        f"input length and `max_tokens` exceed context limit: {counted} + 1000 > 512, "
        "decrease input length or `max_tokens` and try again"
    )
    long = user("word " * 600)
    counted = (
        anthropic_client(scripted).messages.count_tokens(model="m", messages=long).input_tokens
    )
    message = error_of(post(scripted, base(messages=long)), 400, "invalid_request_error")
    assert message.startswith(f"prompt is too long: {counted} tokens > 512 maximum")


def test_bad_body_and_routes(scripted):
    for raw in (b"", b"{not json", b"[1, 2]"):
        r = httpx.post(
            scripted.base_url + "/v1/messages",
            content=raw,
            headers={"content-type": "application/json"},
        )
        error_of(r, 400, "invalid_request_error")
    error_of(post(scripted, base(), path="/v1/messages/nope"), 404, "not_found_error")
    r = httpx.get(scripted.base_url + "/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error"
    big = base(messages=user("x" * (11 * 1024 * 1024)))
    error_of(post(scripted, big), 413, "request_too_large")
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client(scripted).messages.create(model="m", max_tokens=5, messages=[])
    assert e.value.body["error"]["type"] == "invalid_request_error"


def test_count_tokens_errors(scripted):
    error_of(
        post(scripted, {"model": "m"}, path="/v1/messages/count_tokens"),
        400,
        "invalid_request_error",
    )
    body = {"model": "m", "messages": user(), "tools": [{"name": "f"}]}
    error_of(post(scripted, body, path="/v1/messages/count_tokens"), 400, "invalid_request_error")


def test_overloaded_is_529(scripted):
    scripted.engine.max_queue = 0
    error_of(post(scripted, base()), 529, "overloaded_error")
    with pytest.raises(anthropic.OverloadedError):
        anthropic_client(scripted).messages.create(model="m", max_tokens=5, messages=user())
    scripted.engine.max_queue = 64
    assert post(scripted, base()).status_code == 200


def test_failure_after_the_stream_began(scripted):
    scripted.engine.push("partial", " text", finish="error")
    events = stream_events(scripted, base())
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"] and "content_block_delta" in names
    assert names[-1] == "error" and "message_stop" not in names
    assert events[-1][1]["error"]["type"] == "api_error"
    scripted.engine.push("partial", finish="error")
    error_of(post(scripted, base()), 500, "api_error")
    scripted.engine.push("ok")
    assert post(scripted, base()).status_code == 200


def test_auth_with_x_api_key_and_bearer(scripted_factory):
    srv = scripted_factory(api_key="sekret")
    error_of(post(srv, base()), 401, "authentication_error")
    error_of(post(srv, base(), headers={"x-api-key": "wrong"}), 401, "authentication_error")
    with pytest.raises(anthropic.AuthenticationError):
        anthropic_client(srv, api_key="wrong").messages.create(
            model="m", max_tokens=5, messages=user()
        )
    srv.engine.push("yes")
    msg = anthropic_client(srv, api_key="sekret").messages.create(
        model="m", max_tokens=5, messages=user()
    )
    assert msg.content[0].text == "yes"
    srv.engine.push("bearer")
    via_token = anthropic.Anthropic(
        base_url=srv.base_url, auth_token="sekret", _strict_response_validation=True, max_retries=0
    )
    assert via_token.messages.create(model="m", max_tokens=5, messages=user()).content[0].text == (
        "bearer"
    )
    assert anthropic_client(srv, api_key="sekret").messages.count_tokens(model="m", messages=user())


# ---- cancellation ------------------------------------------------------------------------


def test_client_disconnect_stops_generation(scripted):
    scripted.engine.push(*["tok"] * 400, delay=0.1)  # 40 s if nobody stopped it
    with httpx.stream(
        "POST", scripted.base_url + "/v1/messages", json=base(stream=True), timeout=30
    ) as resp:
        for line in resp.iter_lines():
            if "text_delta" in line:
                break
        assert scripted.engine.active_count == 1
    assert wait_until(lambda: scripted.engine.active_count == 0)


def test_a_silent_stream_gets_pings(scripted_factory):
    """A long prefill sends nothing for minutes: pings keep the connection alive."""
    scripted = scripted_factory(app_kw={"keepalive_s": 0.05})
    scripted.engine.push("", "Hi", delay=1.0)  # a first token a second late, then the end
    events = stream_events(scripted, base())
    names = [n for n, _ in events]
    first_block = names.index("content_block_start")
    assert names[:2] == ["message_start", "ping"]
    assert names[2:first_block].count("ping") >= 2  # more pings while the prompt "prefills"
    without_pings = [e for i, e in enumerate(events) if i < 2 or e[0] != "ping"]
    check_stream_order(without_pings)
    text = "".join(d["delta"].get("text", "") for n, d in events if n == "content_block_delta")
    assert text == "Hi"


def test_disconnect_while_waiting_for_the_first_token_frees_the_slot(scripted_factory):
    scripted = scripted_factory(app_kw={"keepalive_s": 0.05})
    scripted.engine.push(*[""] * 200, "tok", delay=0.1)  # silent for 20 s
    body = base(stream=True, max_tokens=300)
    with httpx.stream("POST", scripted.base_url + "/v1/messages", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        pings = 0
        for line in resp.iter_lines():
            pings += line == "event: ping"
            if pings == 3:
                break
        assert scripted.engine.active_count == 1
    assert wait_until(lambda: scripted.engine.active_count == 0)


def test_v1_cancel_ends_the_turn(scripted):
    scripted.engine.push(*["tok"] * 400, delay=0.1)
    out: dict = {}

    def run() -> None:
        out["r"] = post(scripted, base())

    t = threading.Thread(target=run)
    t.start()
    assert wait_until(lambda: scripted.engine.active_count == 1)
    r = httpx.post(scripted.base_url + "/v1/cancel", json={})
    assert r.json()["cancelled_count"] == 1
    t.join(20)
    body = out["r"].json()
    MESSAGE.validate(body)
    assert body["stop_reason"] == "end_turn"
    assert body["usage"]["output_tokens"] < 400


def test_v1_cancel_by_message_id_ends_the_stream(scripted):
    scripted.engine.push(*["tok"] * 400, delay=0.1)
    events = []
    with httpx.stream(
        "POST", scripted.base_url + "/v1/messages", json=base(stream=True), timeout=30
    ) as resp:
        name = None
        for line in resp.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
                check_event(name, data)
                events.append((name, data))
                if name == "message_start":
                    target = {"id": data["message"]["id"]}
                    r = httpx.post(scripted.base_url + "/v1/cancel", json=target)
                    assert r.json()["cancelled_count"] == 1
    check_stream_order(events)
    assert events[-2][1]["delta"]["stop_reason"] == "end_turn"
    assert events[-2][1]["usage"]["output_tokens"] < 400
