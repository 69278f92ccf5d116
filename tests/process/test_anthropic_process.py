"""Anthropic Messages API end to end: the real ``mlx-server`` process.

On the tiny random-weight model the wording is noise, so that test checks structure; the
demo-model tests check facts.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from clients import anthropic_client
from payloads import closed_object
from support import MESSAGE, ServerProcess, check_stream_order, stream_events

QUESTION = [{"role": "user", "content": "hello"}]


def without_ids(msg: anthropic.types.Message) -> dict:
    out = msg.model_dump(exclude={"id"})
    for block in out["content"]:
        block.pop("id", None)
    return out


def test_message_stream_and_count_on_a_real_model(tiny_server):
    c = anthropic_client(tiny_server)
    # Current SDKs no longer have sampling arguments; older clients still send them.
    kw = dict(model="tiny", max_tokens=8, messages=QUESTION, extra_body={"temperature": 0})
    raw = {"model": "tiny", "max_tokens": 8, "messages": QUESTION, "temperature": 0}
    r = httpx.post(tiny_server.base_url + "/v1/messages", json=raw, timeout=120)
    assert r.status_code == 200, r.text
    MESSAGE.validate(r.json())
    msg = c.messages.create(**kw)
    assert msg.model == "tiny" and msg.id.startswith("msg_")
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert 0 < msg.usage.output_tokens <= 8
    counted = c.messages.count_tokens(model="tiny", messages=QUESTION).input_tokens
    # Anthropic's split: what came from the prompt cache is not in input_tokens.
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == counted
    assert msg.usage.input_tokens > 0

    events = stream_events(tiny_server, raw)
    check_stream_order(events)
    with c.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    assert without_ids(streamed)["content"] == without_ids(msg)["content"]  # greedy: same text
    assert streamed.stop_reason == msg.stop_reason
    assert streamed.usage.output_tokens == msg.usage.output_tokens


@pytest.fixture
def demo(demo_server: ServerProcess) -> ServerProcess:
    return demo_server  # the session's demo-model server (conftest.py)


@pytest.mark.demo
def test_demo_model_answers_through_the_sdk(demo):
    msg = anthropic_client(demo).messages.create(
        model="smollm2",
        max_tokens=40,
        extra_body={"temperature": 0},
        system="You are a helpful assistant. Answer in one short sentence.",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert msg.stop_reason in ("end_turn", "max_tokens")
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert "Paris" in text


@pytest.mark.demo
@pytest.mark.timeout(600)  # demo-model generations: up to 3 minutes on a loaded 2-core machine
def test_demo_model_forced_tool_use_streams_its_input(demo):
    tool = {
        "name": "get_weather",
        "description": "Current weather for a city",
        "input_schema": closed_object({"city": {"type": "string"}}),
    }
    with anthropic_client(demo).messages.stream(
        model="smollm2",
        max_tokens=100,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
    ) as stream:
        json_deltas = [e for e in stream if e.type == "input_json"]
        msg = stream.get_final_message()
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert [u.name for u in uses] == ["get_weather"]
    assert list(uses[0].input) == ["city"] and isinstance(uses[0].input["city"], str)
    assert msg.stop_reason == "tool_use"
    assert len(json_deltas) > 1  # the arguments arrived piece by piece


@pytest.mark.demo
def test_demo_model_structured_output(demo):
    schema = closed_object({"capital": {"type": "string"}})
    msg = anthropic_client(demo).messages.create(
        model="smollm2",
        max_tokens=60,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert list(json.loads(text)) == ["capital"]


def test_message_start_reports_the_real_cache_split(tiny_server):
    """The second identical request reuses the first one's prefix: message_start (sent
    before any text) already says so, and agrees with the final usage."""
    history = [
        {"role": "user", "content": "tell me about the sea " * 8},
        {"role": "assistant", "content": "the sea is wide"},
        {"role": "user", "content": "and the sky?"},
    ]
    raw = {"model": "tiny", "max_tokens": 4, "messages": history, "temperature": 0, "stream": True}
    stream_events(tiny_server, raw)  # fills the prefix cache
    events = [data for _, data in stream_events(tiny_server, raw)]
    start = events[0]["message"]["usage"]
    final = [e for e in events if e["type"] == "message_delta"][-1]["usage"]
    assert start["cache_read_input_tokens"] > 10
    assert start["cache_read_input_tokens"] == final.get("cache_read_input_tokens")
    assert start["input_tokens"] == final.get("input_tokens", start["input_tokens"])
