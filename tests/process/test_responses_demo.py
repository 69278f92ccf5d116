"""The Responses API on the real demo model (a real engine, prefix cache and grammar).

The SDK runs with strict response validation; raw bodies and stream events are validated
against the vendored schemas. Facts are asserted, not wording.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from clients import openai_client
from payloads import closed_object
from pydantic import BaseModel, Field
from responses_spec import parse_sse, validate_event, validate_response
from support import ServerProcess

pytestmark = pytest.mark.demo

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": closed_object({"city": {"type": "string", "maxLength": 20}}),
    "strict": True,
}


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population: int = Field(ge=0, le=50_000_000)


@pytest.fixture
def demo(demo_server: ServerProcess) -> ServerProcess:
    return demo_server  # the session's demo-model server (conftest.py)


def test_create_and_stream(demo):
    c = openai_client(demo, timeout=120)
    r = c.responses.create(
        model="demo", input="What is the capital of France?", temperature=0, max_output_tokens=24
    )
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 24
    validate_response(httpx.get(f"{demo.base_url}/v1/responses/{r.id}").json())
    with c.responses.stream(
        model="demo", input="What is the capital of France?", temperature=0, max_output_tokens=24
    ) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == final.output_text == r.output_text  # temperature 0: the same answer


def test_parse_with_pydantic_model(demo):
    r = openai_client(demo, timeout=120).responses.parse(
        model="demo",
        input="Describe Paris as JSON.",
        text_format=City,
        temperature=0,
        max_output_tokens=80,
    )
    assert r.status == "completed"
    city = r.output_parsed
    assert isinstance(city, City)
    City.model_validate_json(r.output_text)  # the grammar made it valid
    assert r.text.format.type == "json_schema" and r.text.format.name == "City"


@pytest.mark.timeout(600)  # demo-model generations: up to 3 minutes on a loaded 2-core machine
def test_tool_round_trip(demo):
    c = openai_client(demo, timeout=120)
    first = c.responses.create(
        model="demo",
        input="What is the weather in Paris?",
        tools=[TOOL],
        tool_choice="required",
        temperature=0,
        max_output_tokens=60,
    )
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    args = json.loads(calls[0].arguments)
    assert isinstance(args["city"], str)
    second = c.responses.create(
        model="demo",
        previous_response_id=first.id,
        tools=[TOOL],
        input=[
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "22C, sunny"}
        ],
        temperature=0,
        max_output_tokens=40,
    )
    assert second.status in ("completed", "incomplete")
    assert second.usage.input_tokens > first.usage.input_tokens
    # the whole first turn (prompt and call) was reused from the prefix cache
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


@pytest.mark.timeout(600)  # demo-model generations: up to 3 minutes on a loaded 2-core machine
def test_three_turns_reuse_the_prefix_cache(demo):
    c = openai_client(demo, timeout=120)
    prev = None
    cached = []
    sizes = []
    for question in ("Name a fruit.", "Name a color.", "Name an animal."):
        r = c.responses.create(
            model="demo",
            input=question,
            previous_response_id=prev,
            temperature=0,
            max_output_tokens=16,
            instructions="Answer in one word.",
        )
        prev = r.id
        cached.append(r.usage.input_tokens_details.cached_tokens)
        sizes.append(r.usage.input_tokens)
    assert sizes[0] < sizes[1] < sizes[2]
    assert cached[1] >= sizes[0] and cached[2] >= sizes[1]  # each turn reuses the last one
    assert cached[0] < cached[1] < cached[2]


def test_cancel_a_running_stream(demo):
    body = {
        "model": "demo",
        "input": "Write a very long story about a dragon.",
        "max_output_tokens": 1500,
        "temperature": 0,  # greedy: the same long answer every run, never one that ends early
        "stream": True,
    }
    with httpx.stream("POST", demo.base_url + "/v1/responses", json=body, timeout=120) as resp:
        lines = resp.iter_lines()
        seen: list[str] = []
        for line in lines:
            seen.append(line)
            if '"response.output_text.delta"' in line:
                break
        rid = parse_sse(seen)[0]["response"]["id"]
        cancelled = httpx.post(f"{demo.base_url}/v1/responses/{rid}/cancel", timeout=60).json()
        events = parse_sse(seen + list(lines))
    for e in events:
        validate_event(e)
    validate_response(cancelled)
    assert cancelled["status"] == "cancelled"
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["usage"]["output_tokens"] < 1500
    deadline = time.time() + 30
    while httpx.get(demo.base_url + "/health").json()["active"]:
        assert time.time() < deadline, "the generation kept running"
        time.sleep(0.05)
