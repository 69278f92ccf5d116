"""Anthropic request mapping (adapter) and event encoding (encoder), without a server."""

from __future__ import annotations

import pytest

from mlx_server.engine.core.handle import Started
from mlx_server.errors import InvalidRequest, UnsupportedFeature
from mlx_server.events import (
    Finished,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from mlx_server.protocols.anthropic.accumulator import MessageAccumulator
from mlx_server.protocols.anthropic.adapter import to_chat_request
from mlx_server.protocols.anthropic.encoder import MessagesEncoder
from mlx_server.protocols.anthropic.messages import strip_billing_header, system_text
from mlx_server.protocols.anthropic.schemas import (
    CountTokensRequest,
    MessagesRequest,
    SystemBlock,
)
from mlx_server.protocols.anthropic.stream import StreamEncoder
from mlx_server.types import ToolChoice

PNG = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
TOOL = {"name": "f", "description": "d", "input_schema": {"type": "object"}}


def chat(vision: bool = False, **kw):
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    body.update(kw)
    return to_chat_request(MessagesRequest.model_validate(body), vision=vision)


def convo(*messages, vision: bool = False) -> list[dict]:
    return chat(vision=vision, messages=list(messages)).messages


# ---- messages ----------------------------------------------------------------------------


def test_tool_results_become_tool_messages_in_order():
    msgs = convo(
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "plan", "signature": "s"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Calling."},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
                {"type": "tool_use", "id": "t2", "name": "g", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "one"},
                {
                    "type": "tool_result",
                    "tool_use_id": "t2",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    "is_error": True,
                },
                {"type": "text", "text": "now what?"},
            ],
        },
    )
    assert msgs == [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "Calling.",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
                {"id": "t2", "type": "function", "function": {"name": "g", "arguments": {}}},
            ],
            "reasoning_content": "plan",
        },
        {"role": "tool", "content": "one", "tool_call_id": "t1", "name": "f"},
        {"role": "tool", "content": "Error: a\nb", "tool_call_id": "t2", "name": "g"},
        {"role": "user", "content": "now what?"},
    ]


def test_text_before_a_tool_result_keeps_its_place():
    msgs = convo(
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "first"},
                {"type": "tool_result", "tool_use_id": "x"},
                {"type": "text", "text": "last"},
            ],
        }
    )
    assert [m["role"] for m in msgs] == ["user", "tool", "user"]
    assert msgs[1] == {"role": "tool", "content": "", "tool_call_id": "x"}  # no name known
    assert [msgs[0]["content"], msgs[2]["content"]] == ["first", "last"]


def test_only_tool_results_make_no_empty_user_message():
    msgs = convo({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]})
    assert [m["role"] for m in msgs] == ["tool"]


def test_images_need_vision_and_then_become_hf_parts():
    content = [
        {"type": "text", "text": "what is this?"},
        {"type": "image", "source": PNG},
        {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
    ]
    with pytest.raises(InvalidRequest, match=r"messages\[0\]\.content\[1\] is an image block"):
        convo({"role": "user", "content": content})
    msgs = convo({"role": "user", "content": content}, vision=True)
    assert msgs == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this?"},
                {
                    "type": "image",
                    "image": "data:image/png;base64,iVBORw0KGgo=",
                    "param": "messages[0].content[1]",
                },
                {"type": "image", "image": "https://x/y.png", "param": "messages[0].content[2]"},
            ],
        }
    ]
    result = {
        "type": "tool_result",
        "tool_use_id": "t",
        "content": [{"type": "image", "source": PNG}],
    }
    with pytest.raises(InvalidRequest, match=r"content\[0\]\.content\[0\]"):
        convo({"role": "user", "content": [result]})
    tool_msg = convo({"role": "user", "content": [result]}, vision=True)[0]
    assert tool_msg["content"] == [
        {
            "type": "image",
            "image": "data:image/png;base64,iVBORw0KGgo=",
            "param": "messages[0].content[0].content[0]",
        }
    ]
    bad = {"type": "image", "source": {**PNG, "media_type": "image/tiff"}}
    with pytest.raises(InvalidRequest, match="media_type"):
        convo({"role": "user", "content": [bad]}, vision=True)


def test_text_only_messages_stay_strings_even_with_vision():
    msgs = convo({"role": "user", "content": [{"type": "text", "text": "a"}]}, vision=True)
    assert msgs == [{"role": "user", "content": "a"}]


# ---- system and the billing header -------------------------------------------------------

BILLING = "x-anthropic-billing-header: cc_version=2.1.117.48f; cc_entrypoint=cli; cch=71fea;"


def test_billing_header_block_is_dropped():
    blocks = [
        SystemBlock(type="text", text=BILLING),
        SystemBlock(type="text", text="You are Claude Code."),
        SystemBlock(type="text", text="Rules."),
    ]
    assert system_text(blocks) == "You are Claude Code.\nRules."


def test_billing_header_line_is_removed_from_text():
    assert strip_billing_header(f"{BILLING}\nYou are Claude Code.") == "You are Claude Code."
    assert system_text(f"{BILLING}\nYou are helpful.") == "You are helpful."
    blocks = [SystemBlock(type="text", text=f"{BILLING}\nYou are Claude Code.")]
    assert system_text(blocks) == "You are Claude Code."
    # Mentions of the header that are not the header line stay.
    text = "Explain what x-anthropic-billing-header: is."
    assert strip_billing_header(text) == text


def test_system_becomes_the_first_message():
    msgs = chat(system=[{"type": "text", "text": BILLING}, {"type": "text", "text": "S"}]).messages
    assert msgs[0] == {"role": "system", "content": "S"}
    assert chat(system=BILLING).messages[0]["role"] == "user"  # nothing left: no system message


def test_system_messages_stay_in_place():
    """Current SDKs type ``{"role": "system"}`` messages; Claude Code sends one after the
    first user turn. Each stays where it is; text blocks are joined like ``system``'s."""
    msgs = chat(
        system="Top.",
        messages=[
            {"role": "user", "content": "u1"},
            {"role": "system", "content": "Agents: Explore, Plan."},
            {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "u2"},
            {
                "role": "system",
                "content": [
                    {"type": "text", "text": "Be terse.", "cache_control": {"type": "ephemeral"}},
                    {"type": "text", "text": "No emoji."},
                ],
            },
        ],
    ).messages
    assert msgs == [
        {"role": "system", "content": "Top."},
        {"role": "user", "content": "u1"},
        {"role": "system", "content": "Agents: Explore, Plan."},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
        {"role": "system", "content": "Be terse.\nNo emoji."},
    ]


def test_leading_and_consecutive_system_messages_merge():
    msgs = chat(
        system="Top.",
        messages=[
            {"role": "system", "content": "First."},
            {"role": "user", "content": "u1"},
            {"role": "system", "content": "A."},
            {"role": "system", "content": [{"type": "text", "text": "B."}]},
        ],
    ).messages
    assert msgs == [
        {"role": "system", "content": "Top.\nFirst."},
        {"role": "user", "content": "u1"},
        {"role": "system", "content": "A.\nB."},
    ]
    # Without a top-level system prompt a leading system message is the system prompt.
    lone = convo({"role": "system", "content": "S"}, {"role": "user", "content": "u"})
    assert lone == [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}]


def test_system_messages_take_text_only_and_not_alone():
    with pytest.raises(InvalidRequest, match=r"messages\[1\]\.content\[0\]: a system message"):
        convo(
            {"role": "user", "content": "u"},
            {"role": "system", "content": [{"type": "image", "source": PNG}]},
            vision=True,
        )
    with pytest.raises(InvalidRequest, match="at least one message must be a user or assistant"):
        convo({"role": "system", "content": "S"})


# ---- tools, tool_choice, thinking, structured output -------------------------------------


def test_tools_and_tool_choice_mapping():
    req = chat(tools=[TOOL])
    assert req.tools == [
        {
            "type": "function",
            "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
        }
    ]
    assert req.tool_choice == ToolChoice("auto") and req.parallel_tool_calls
    cases = {
        "auto": ToolChoice("auto"),
        "none": ToolChoice("none"),
        "any": ToolChoice("required"),
    }
    for kind, want in cases.items():
        assert chat(tools=[TOOL], tool_choice={"type": kind}).tool_choice == want
    named = chat(tools=[TOOL], tool_choice={"type": "tool", "name": "f"})
    assert named.tool_choice == ToolChoice("function", "f")
    once = chat(tools=[TOOL], tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert once.parallel_tool_calls is False
    with pytest.raises(InvalidRequest, match="tool_choice.name"):
        chat(tools=[TOOL], tool_choice={"type": "tool"})
    with pytest.raises(UnsupportedFeature, match="server tool"):
        chat(tools=[{"type": "bash_20250124", "name": "bash"}])
    typed = chat(tools=[{**TOOL, "type": "custom", "cache_control": {"type": "ephemeral"}}])
    assert typed.tools is not None and typed.tools[0]["function"]["name"] == "f"


def test_thinking_sets_enable_thinking_and_reasoning_effort():
    assert chat().template_kwargs == {}
    on = chat(thinking={"type": "enabled", "budget_tokens": 1024})
    assert on.template_kwargs == {"enable_thinking": True, "reasoning_effort": "low"}
    big = chat(thinking={"type": "enabled", "budget_tokens": 20000})
    assert big.template_kwargs["reasoning_effort"] == "high"
    adaptive = chat(thinking={"type": "adaptive"}).template_kwargs
    assert adaptive == {"enable_thinking": True, "reasoning_effort": "medium"}
    off = chat(thinking={"type": "disabled"}).template_kwargs
    assert off == {"enable_thinking": False, "reasoning_effort": "low"}
    effort = chat(thinking={"type": "adaptive"}, output_config={"effort": "high"})
    assert effort.template_kwargs["reasoning_effort"] == "high"
    assert chat(output_config={"effort": "low"}).template_kwargs == {"reasoning_effort": "low"}


def test_claude_code_extra_fields_are_accepted():
    """Fields Claude Code 2.1 sends that change nothing here."""
    req = chat(
        thinking={"type": "adaptive"},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        output_config={"effort": "high"},
        metadata={"user_id": '{"device_id":"d","session_id":"s"}'},
    )
    # adaptive thinking turns the template's thinking on; effort sets its level, if it has one
    assert req.template_kwargs == {"enable_thinking": True, "reasoning_effort": "high"}
    assert req.response_format is None
    assert req.messages == [{"role": "user", "content": "hi"}]


def test_output_config_format_is_structured_output():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = chat(output_config={"format": {"type": "json_schema", "schema": schema}})
    assert req.response_format == {"type": "json_schema", "schema": schema}
    assert chat(output_config={"effort": "low"}).response_format is None


def test_count_tokens_request_maps_without_generation_fields():
    body = CountTokensRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL]}
    )
    req = to_chat_request(body)
    assert req.max_tokens is None and req.stop == () and req.tools is not None


# ---- encoder -----------------------------------------------------------------------------


def run(events, fin: Finished, *, prompt: int = 10, cached: int = 0):
    enc = StreamEncoder("msg_1", "m", prompt)
    stream = enc.start(cached)
    for ev in events:
        stream += enc.event(ev)
    stream += enc.finish(fin)
    acc = MessageAccumulator()
    for e in stream:
        acc.add(e)
    return stream, acc.message


def test_cached_prompt_tokens_are_reported_apart():
    stream, msg = run([TextDelta("x")], Finished("stop", Usage(100, 5, 40)), prompt=100, cached=40)
    usage = msg["usage"]
    assert usage["input_tokens"] == 60 and usage["cache_read_input_tokens"] == 40
    assert usage["output_tokens"] == 5 and usage["cache_creation_input_tokens"] == 0
    assert stream[0]["message"]["usage"]["input_tokens"] == 60


def test_arguments_sent_at_the_end_of_a_call_are_streamed_once():
    events = [
        ToolCallStart(0, "call_abc", "f"),
        ToolCallEnd(0, '{"a": [1, 2]}'),
        ToolCallStart(1, "call_def", "f"),
        ToolCallArgsDelta(1, '{"b":'),
        ToolCallArgsDelta(1, " 2}"),
        ToolCallEnd(1, '{"b": 2}'),
    ]
    stream, msg = run(events, Finished("tool_calls", Usage(10, 3)))
    json_deltas = [e["delta"]["partial_json"] for e in stream if e["type"] == "content_block_delta"]
    assert json_deltas == ['{"a": [1, 2]}', '{"b":', " 2}"]
    assert [b["input"] for b in msg["content"]] == [{"a": [1, 2]}, {"b": 2}]
    assert [b["id"] for b in msg["content"]] == ["toolu_abc", "toolu_def"]
    assert msg["stop_reason"] == "tool_use"


def test_blocks_follow_the_output_order():
    events = [
        ReasoningDelta("a"),
        ReasoningDelta(""),
        TextDelta("b"),
        ReasoningDelta("c"),
        TextDelta(""),
        TextDelta("d"),
    ]
    _, msg = run(events, Finished("length", Usage(10, 4)))
    assert [(b["type"], b.get("thinking", b.get("text"))) for b in msg["content"]] == [
        ("thinking", "a"),
        ("text", "b"),
        ("thinking", "c"),
        ("text", "d"),
    ]
    assert all(b["signature"] for b in msg["content"] if b["type"] == "thinking")
    assert msg["stop_reason"] == "max_tokens"


def test_stop_reasons():
    cases = {
        "stop": "end_turn",
        "length": "max_tokens",
        "tool_calls": "tool_use",
        "cancelled": "end_turn",
    }
    for reason, want in cases.items():
        _, msg = run([], Finished(reason, Usage(1, 0)))
        assert msg["stop_reason"] == want and msg["stop_sequence"] is None
    _, msg = run([], Finished("stop_sequence", Usage(1, 0), stop_sequence="##"))
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", "##")


def test_consecutive_turns_of_one_role_are_merged():
    msgs = convo(
        {"role": "user", "content": "a"},
        {"role": "user", "content": [{"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t"}]},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
        {"role": "user", "content": "c"},
    )
    assert msgs == [
        {"role": "user", "content": "a\nb"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "f", "arguments": {}}}
            ],
            "reasoning_content": "t",
        },
        {"role": "tool", "content": "", "tool_call_id": "t1", "name": "f"},
        {"role": "user", "content": "c"},
    ]
    with_image = convo(
        {"role": "user", "content": "look"},
        {"role": "user", "content": [{"type": "image", "source": PNG}]},
        vision=True,
    )
    assert with_image == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {
                    "type": "image",
                    "image": "data:image/png;base64,iVBORw0KGgo=",
                    "param": "messages[1].content[0]",
                },
            ],
        }
    ]


@pytest.mark.parametrize("collect", [False, True])
def test_message_start_carries_the_start_events_cache_split(collect):
    enc = MessagesEncoder(StreamEncoder("msg_1", "m", 100))
    assert enc.open(collect) == []
    opening = enc.start(0, Started(cached_tokens=40))
    closing = enc.finish(0, Finished("stop", Usage(100, 0, 40)))
    if collect:
        assert opening == closing == []
        assert enc.result()["usage"]["cache_read_input_tokens"] == 40
    else:
        assert opening[0].event == "message_start"
        assert opening[0].data["message"]["usage"]["cache_read_input_tokens"] == 40


@pytest.mark.parametrize("collect", [False, True])
def test_a_message_cancelled_before_it_started_still_opens(collect):
    enc = MessagesEncoder(StreamEncoder("msg_1", "m", 7))
    enc.open(collect)
    frames = enc.finish(0, Finished("cancelled", Usage(7, 0)))
    if collect:
        assert frames == [] and enc.result()["usage"]["input_tokens"] == 7
    else:
        assert [f.event for f in frames][0] == "message_start"
