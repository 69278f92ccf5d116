"""Tool calls and reasoning split through the real server stack (scripted engine, openai SDK)."""

from __future__ import annotations

import json

import httpx
import pytest
from clients import openai_client
from payloads import WEATHER, chat
from support import schema_validator, start_in_process

CHUNK = schema_validator("CreateChatCompletionStreamResponse")
COMPLETION = schema_validator("CreateChatCompletionResponse")

TOOLS = [
    WEATHER,
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"tz": {"type": ["string", "null"], "default": None}},
            },
        },
    },
]

TWO_CALLS = [
    "Let me check. ",
    '<tool_call>\n{"name": "get_',
    'weather", "arguments": {"city": "Pa',
    'ris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", ',
    '"arguments": {"tz": "CET"}}\n</tool_call>',
]


def raw_stream(srv, body: dict) -> list[dict]:
    with httpx.stream(
        "POST", srv.base_url + "/v1/chat/completions", json={**body, "stream": True}
    ) as r:
        assert r.status_code == 200
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    for e in events:
        CHUNK.validate(e)
    return events


def test_reasoning_then_content_stream_and_non_stream(scripted):
    pieces = ["<thi", "nk>Let me ", "think</th", "ink>\n\nThe answer", " is 4."]
    scripted.engine.push(*pieces)
    events = raw_stream(scripted, {"model": "m", "messages": [{"role": "user", "content": "2+2?"}]})
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert reasoning == "Let me think"
    assert content.strip() == "The answer is 4."
    assert "<think>" not in content + reasoning and "</think>" not in content + reasoning
    scripted.engine.push(*pieces)
    msg = (
        openai_client(scripted)
        .chat.completions.create(model="m", messages=[{"role": "user", "content": "2+2?"}])
        .choices[0]
        .message
    )
    assert msg.reasoning_content == "Let me think"  # type: ignore[attr-defined]
    assert msg.content == content


def test_reasoning_format_none_gives_raw_text(scripted):
    scripted.engine.push("<think>hmm</think>", "ok")
    r = httpx.post(
        scripted.base_url + "/v1/chat/completions",
        json=chat("x", reasoning_format="none"),
    ).json()
    assert r["choices"][0]["message"]["content"] == "<think>hmm</think>ok"
    assert "reasoning_content" not in r["choices"][0]["message"]


def test_unterminated_reasoning_says_length(scripted):
    scripted.engine.push("<think>still thinking", " and thinking")
    r = httpx.post(
        scripted.base_url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
    ).json()
    msg = r["choices"][0]
    assert (
        msg["message"]["content"] == ""
        and msg["message"]["reasoning_content"] == "still thinking and thinking"
    )
    assert msg["finish_reason"] == "length"


def test_two_parallel_tool_calls_streamed_and_reassembled_by_sdk(scripted):
    scripted.engine.push(*TWO_CALLS)
    events = raw_stream(
        scripted, {"model": "m", "messages": [{"role": "user", "content": "w?"}], "tools": TOOLS}
    )
    calls = [
        tc
        for e in events
        if e["choices"]
        for tc in e["choices"][0]["delta"].get("tool_calls") or []
    ]
    starts = [tc for tc in calls if "id" in tc]
    assert [tc["index"] for tc in starts] == [0, 1]
    assert all(tc["id"].startswith("call_") and tc["type"] == "function" for tc in starts)
    assert [tc["function"]["name"] for tc in starts] == ["get_weather", "get_time"]
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert content.strip() == "Let me check." and "<tool_call>" not in content
    finals = [
        e["choices"][0]["finish_reason"]
        for e in events
        if e["choices"] and e["choices"][0]["finish_reason"]
    ]
    assert finals == ["tool_calls"]
    # arguments arrive in more than one piece for the first call (incremental streaming)
    assert (
        len([tc for tc in calls if tc["index"] == 0 and tc.get("function", {}).get("arguments")])
        >= 2
    )

    scripted.engine.push(*TWO_CALLS)
    with openai_client(scripted).chat.completions.stream(
        model="m", messages=[{"role": "user", "content": "w?"}], tools=TOOLS
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    tcs = final.choices[0].message.tool_calls
    assert [t.function.name for t in tcs] == ["get_weather", "get_time"]
    assert json.loads(tcs[0].function.arguments) == {"city": "Paris"}
    assert json.loads(tcs[1].function.arguments) == {"tz": "CET"}
    assert final.choices[0].finish_reason == "tool_calls"


def test_stream_and_non_stream_assemble_the_same_message(scripted):
    scripted.engine.push(*TWO_CALLS)
    full = openai_client(scripted).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "w?"}], tools=TOOLS
    )
    COMPLETION.validate(full.model_dump(exclude_unset=True))
    scripted.engine.push(*TWO_CALLS)
    events = raw_stream(
        scripted, {"model": "m", "messages": [{"role": "user", "content": "w?"}], "tools": TOOLS}
    )
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    args: dict[int, str] = {}
    names: dict[int, str] = {}
    for e in events:
        for tc in (e["choices"][0]["delta"].get("tool_calls") or []) if e["choices"] else []:
            args[tc["index"]] = args.get(tc["index"], "") + tc.get("function", {}).get(
                "arguments", ""
            )
            if "name" in tc.get("function", {}):
                names[tc["index"]] = tc["function"]["name"]
    msg = full.choices[0].message
    assert msg.content == content
    assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == [
        (names[i], json.loads(args[i])) for i in sorted(args)
    ]


def test_non_stream_content_null_when_only_calls(scripted):
    scripted.engine.push('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    r = httpx.post(
        scripted.base_url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "t?"}], "tools": TOOLS},
    ).json()
    m = r["choices"][0]["message"]
    assert m["content"] is None and m["tool_calls"][0]["function"]["arguments"] == "{}"
    assert r["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_round_trip(scripted):
    eng = scripted.engine
    eng.push('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')
    c = openai_client(scripted)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    first = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    msgs.append(first.choices[0].message.model_dump(exclude_none=True))
    msgs.append({"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"})
    eng.push("It is 18 degrees and sunny in Paris.")
    second = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
    assert second.choices[0].message.content == "It is 18 degrees and sunny in Paris."
    assert second.choices[0].finish_reason == "stop"
    prompt = scripted.service.tokenizer.decode(eng.requests[-1].prompt_tokens)
    assert '"name": "get_weather"' in prompt and '"city": "Paris"' in prompt
    assert "18 degrees and sunny" in prompt and prompt.index('"get_weather"') < prompt.index(
        "18 degrees"
    )


def test_no_tools_no_parsing(scripted):
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    scripted.engine.push(text)
    r = httpx.post(
        scripted.base_url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "t?"}]},
    ).json()
    assert (
        r["choices"][0]["message"]["content"] == text
        and "tool_calls" not in r["choices"][0]["message"]
    )


def test_tool_choice_none_hides_tools_and_does_not_parse(scripted):
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    scripted.engine.push(text)
    r = httpx.post(
        scripted.base_url + "/v1/chat/completions",
        json=chat("t?", tools=TOOLS, tool_choice="none"),
    ).json()
    assert r["choices"][0]["message"]["content"] == text
    prompt = scripted.service.tokenizer.decode(scripted.engine.requests[-1].prompt_tokens)
    assert "get_weather" not in prompt


def test_parallel_tool_calls_false_keeps_first(scripted):
    scripted.engine.push(*TWO_CALLS)
    r = httpx.post(
        scripted.base_url + "/v1/chat/completions",
        json=chat("w?", tools=TOOLS, parallel_tool_calls=False),
    ).json()
    calls = r["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert "<tool_call>" not in (r["choices"][0]["message"]["content"] or "")


def test_unparseable_call_comes_back_as_content(scripted):
    text = "<tool_call>{not json at all}</tool_call>"
    scripted.engine.push(text)
    r = httpx.post(
        scripted.base_url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "t?"}], "tools": TOOLS},
    ).json()
    assert "not json at all" in r["choices"][0]["message"]["content"]
    assert r["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "tools,needle",
    [
        ({"type": "function"}, "tools"),
        ([{"type": "function", "function": {"description": "no name"}}], "tools[0]"),
        (
            [
                TOOLS[0],
                {"type": "function", "function": {"name": "f", "parameters": "not an object"}},
            ],
            "tools[1]",
        ),
        (["just a string"], "tools[0]"),
    ],
)
def test_malformed_tools_400(scripted, tools, needle):
    r = httpx.post(
        scripted.base_url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": tools},
    )
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert httpx.get(scripted.base_url + "/health").status_code == 200


def test_null_inside_schema_is_accepted(scripted):
    scripted.engine.push("fine")
    r = httpx.post(
        scripted.base_url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [TOOLS[1]]},
    )
    assert r.status_code == 200, r.text


def _tokenizer_with(tmp_path, template: str):
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from tiny_model import build_tokenizer

    build_tokenizer(tmp_path, template)
    return load_tokenizer(tmp_path)


OPENER = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}"
)


def test_template_opened_reasoning_and_enable_thinking_kwarg(tmp_path):
    srv = start_in_process(_tokenizer_with(tmp_path, OPENER))
    try:
        srv.engine.push("I should add.", "</think>", "\n\n4")
        r = httpx.post(
            srv.base_url + "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "2+2"}]},
        ).json()
        msg = r["choices"][0]["message"]
        assert msg["reasoning_content"] == "I should add." and msg["content"].strip() == "4"
        # with thinking switched off the prompt closes the block: everything is content
        srv.engine.push("4")
        r = httpx.post(
            srv.base_url + "/v1/chat/completions",
            json=chat("2+2", chat_template_kwargs={"enable_thinking": False}),
        ).json()
        assert (
            r["choices"][0]["message"]["content"] == "4"
            and "reasoning_content" not in r["choices"][0]["message"]
        )
        prompt = srv.service.tokenizer.decode(srv.engine.requests[-1].prompt_tokens)
        assert prompt.endswith("</think>\n\n")
    finally:
        srv.stop()
