"""gpt-oss end to end: its real chat template and Harmony special tokens on a tiny tokenizer,
scripted Harmony output, through both APIs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from clients import sse_data
from payloads import WEATHER, anthropic_tool, anthropic_tool_round_trip, openai_tool_round_trip
from scripted_engine import ScriptedEngine
from starlette.testclient import TestClient
from template_corpus import TEMPLATES, load_tokenizer, tokenizer_dir

from mlx_server.boot.app import create_app
from mlx_server.service import ChatService

ANTHROPIC_TOOL = anthropic_tool(WEATHER)
CALL_OUTPUT = (
    "<|channel|>analysis<|message|>The user wants the weather; call the tool.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)
ANSWER_OUTPUT = (
    "<|channel|>analysis<|message|>It said sunny.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>"
)


def pieces(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.fixture(scope="module")
def harmony(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("harmony")
    tokenizer = load_tokenizer(tokenizer_dir(root, TEMPLATES / "openai-gpt-oss-120b.jinja"))
    engine = ScriptedEngine()
    service = ChatService("gpt-oss-tiny", tokenizer, engine, ctx_size=8192)
    with TestClient(create_app(service), base_url="http://localhost") as client:
        yield client, engine, tokenizer, service


def prompt_of(engine: ScriptedEngine, tokenizer) -> str:
    return tokenizer.decode(engine.requests[-1].prompt_tokens)


def post(client: TestClient, path: str, **body: Any) -> Any:
    """A request to the gpt-oss model."""
    return client.post(path, json={"model": "gpt-oss", **body})


def test_detected_as_harmony(harmony):
    _, _, _, service = harmony
    assert service.harmony
    assert service.tool_format is None  # no tagged tool-call format: Harmony carries calls


def test_openai_tool_call_with_reasoning(harmony):
    client, engine, tokenizer, _ = harmony
    engine.push(*pieces(CALL_OUTPUT))
    r = post(
        client,
        "/v1/chat/completions",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        reasoning_effort="high",
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["reasoning_content"] == "The user wants the weather; call the tool."
    assert not message.get("content")
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    prompt = prompt_of(engine, tokenizer)
    assert "Reasoning: high" in prompt
    assert "get_weather" in prompt
    assert prompt.endswith("<|start|>assistant")


def test_openai_stream_splits_channels(harmony):
    client, engine, _, _ = harmony
    engine.push(*pieces(CALL_OUTPUT, 2))
    r = post(
        client,
        "/v1/chat/completions",
        stream=True,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
    )
    chunks = sse_data(r.text.splitlines())
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    assert reasoning == "The user wants the weather; call the tool."
    assert not "".join(d.get("content") or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather"
    arguments = "".join(tc["function"].get("arguments") or "" for tc in calls)
    assert json.loads(arguments) == {"city": "Paris"}
    assert len([tc for tc in calls if tc["function"].get("arguments")]) > 1  # streamed
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_history_renders_back_as_the_template_expects(harmony):
    client, engine, tokenizer, _ = harmony
    engine.push(*pieces(ANSWER_OUTPUT))
    messages = [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": "Rome is cloudy.", "reasoning_content": "OLD-THOUGHT"},
        {"role": "user", "content": "Weather in Paris?"},
        *openai_tool_round_trip(
            "get_weather",
            '{"city": "Paris"}',
            "18 degrees and sunny",
            reasoning_content="Need the tool.",
        ),
    ]
    r = post(client, "/v1/chat/completions", messages=messages, tools=[WEATHER])
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["content"] == "It is sunny in Paris."
    assert message["reasoning_content"] == "It said sunny."
    prompt = prompt_of(engine, tokenizer)
    assert "OLD-THOUGHT" not in prompt  # an earlier turn's analysis is dropped
    assert "<|channel|>final<|message|>Rome is cloudy.<|end|>" in prompt
    assert "<|channel|>analysis<|message|>Need the tool.<|end|>" in prompt
    assert (
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
        '<|message|>{"city": "Paris"}<|call|>'
    ) in prompt
    assert (
        "<|start|>functions.get_weather to=assistant<|channel|>commentary"
        '<|message|>"18 degrees and sunny"<|end|>'
    ) in prompt


def test_anthropic_thinking_and_tool_use(harmony):
    client, engine, tokenizer, _ = harmony
    engine.push(*pieces(CALL_OUTPUT))
    r = post(
        client,
        "/v1/messages",
        max_tokens=200,
        thinking={"type": "enabled", "budget_tokens": 2048},
        tools=[ANTHROPIC_TOOL],
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert [b["type"] for b in body["content"]] == ["thinking", "tool_use"]
    assert body["content"][0]["thinking"] == "The user wants the weather; call the tool."
    assert body["content"][1]["input"] == {"city": "Paris"}
    assert body["stop_reason"] == "tool_use"
    assert "Reasoning: low" in prompt_of(engine, tokenizer)


def test_anthropic_stream_and_history_with_thinking_text_and_tool_use(harmony):
    client, engine, tokenizer, _ = harmony
    engine.push(*pieces(ANSWER_OUTPUT))
    r = post(
        client,
        "/v1/messages",
        max_tokens=200,
        stream=True,
        output_config={"effort": "high"},
        tools=[ANTHROPIC_TOOL],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            *anthropic_tool_round_trip(
                "get_weather",
                {"city": "Paris"},
                "18 degrees and sunny",
                before=(
                    {"type": "thinking", "thinking": "Need the tool.", "signature": "x"},
                    {"type": "text", "text": "Let me check."},
                ),
            ),
        ],
    )
    assert r.status_code == 200, r.text
    events = sse_data(r.text.splitlines())
    thinking = "".join(
        e["delta"].get("thinking", "") for e in events if e["type"] == "content_block_delta"
    )
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert thinking == "It said sunny."
    assert text == "It is sunny in Paris."
    prompt = prompt_of(engine, tokenizer)
    assert "Reasoning: high" in prompt
    assert "Need the tool." in prompt and "Let me check." in prompt
    assert '"18 degrees and sunny"' in prompt


def test_plain_text_output_is_the_answer(harmony):
    """A model that skips the Harmony headers still gets its text through."""
    client, engine, _, _ = harmony
    engine.push("Just ", "an answer.")
    r = post(client, "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}])
    assert r.json()["choices"][0]["message"]["content"] == "Just an answer."


def test_template_file_is_the_real_one():
    source = Path(TEMPLATES / "openai-gpt-oss-120b.jinja").read_text()
    assert "<|channel|>analysis<|message|>" in source and "reasoning_effort" in source


def test_reasoning_format_none_returns_the_raw_channels(harmony):
    client, engine, _, _ = harmony
    engine.push(*pieces(ANSWER_OUTPUT))
    r = post(
        client,
        "/v1/chat/completions",
        reasoning_format="none",
        messages=[{"role": "user", "content": "Hi"}],
    )
    message = r.json()["choices"][0]["message"]
    assert message["content"] == ANSWER_OUTPUT
    assert not message.get("reasoning_content")


def test_unknown_reasoning_effort_is_a_400(harmony):
    client, _, _, _ = harmony
    r = post(
        client,
        "/v1/chat/completions",
        reasoning_effort="extreme",
        messages=[{"role": "user", "content": "Hi"}],
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "reasoning_effort"


def test_anthropic_stream_tool_use_arguments_arrive_as_input_json_deltas(harmony):
    client, engine, _, _ = harmony
    engine.push(*pieces(CALL_OUTPUT, 2))
    r = post(
        client,
        "/v1/messages",
        max_tokens=200,
        stream=True,
        tools=[ANTHROPIC_TOOL],
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    )
    events = sse_data(r.text.splitlines())
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "tool_use"]
    parts = [
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    ]
    assert len(parts) > 1 and json.loads("".join(parts)) == {"city": "Paris"}
    stop = next(e for e in events if e["type"] == "message_delta")
    assert stop["delta"]["stop_reason"] == "tool_use"
