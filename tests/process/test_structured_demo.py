"""Structured output and enforced tool choice on the real demo model (grammar-constrained)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from clients import openai_client
from payloads import chat, closed_object
from support import ServerProcess

# A demo-model server (up to 300 s to start) and generations of up to 300 s each.
pytestmark = [pytest.mark.demo, pytest.mark.timeout(600)]

NAME = {"type": "string", "minLength": 1, "maxLength": 20}

SCHEMAS = [
    # 1. flat object
    closed_object({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    # 2. enum, const, boolean
    closed_object(
        {
            "color": {"enum": ["red", "green", "blue"]},
            "kind": {"const": "paint"},
            "glossy": {"type": "boolean"},
        }
    ),
    # 3. arrays with bounds and a pattern
    closed_object(
        {
            "tags": {
                "type": "array",
                "items": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                "minItems": 1,
                "maxItems": 3,
            },
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        }
    ),
    # 4. nested objects and anyOf
    closed_object(
        {
            "city": closed_object(
                {
                    "name": NAME,
                    "population": {"type": "integer", "minimum": 0, "maximum": 50000000},
                }
            ),
            "capital": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
        }
    ),
    # 5. $defs/$ref, array of objects, nested enum
    {
        "$defs": {"person": closed_object({"name": NAME, "role": {"enum": ["dev", "ops"]}})},
        "type": "object",
        "properties": {
            "team": NAME,
            "members": {
                "type": "array",
                "items": {"$ref": "#/$defs/person"},
                "minItems": 1,
                "maxItems": 2,
            },
        },
        "required": ["team", "members"],
        "additionalProperties": False,
    },
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": closed_object({"city": NAME}),
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": closed_object(
                {
                    "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                    "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
                }
            ),
        },
    },
]


@pytest.fixture
def demo(demo_server: ServerProcess) -> ServerProcess:
    return demo_server  # the session's demo-model server (conftest.py)


def ask_schema(
    srv,
    schema: dict,
    temperature: float,
    seed: int | None = None,
    prompt: str = "Fill in an example.",
) -> dict:
    r = openai_client(srv, timeout=300).chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": prompt}],
        temperature=temperature,
        seed=seed,
        max_tokens=256,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "out", "schema": schema, "strict": True},
        },
    )
    assert r.choices[0].finish_reason == "stop", r
    return json.loads(r.choices[0].message.content)


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.8, 7)])
@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_schemas_validate(demo, index, temperature, seed):
    out = ask_schema(demo, SCHEMAS[index], temperature, seed)
    jsonschema.validate(out, SCHEMAS[index])


def test_json_object(demo):
    r = openai_client(demo, timeout=300).chat.completions.create(
        model="m",
        messages=[
            {
                "role": "user",
                "content": 'Reply with a JSON object with the keys "name" and "color" for a cat.',
            }
        ],
        temperature=0,
        max_tokens=400,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.8, 3)])
def test_tool_choice_required(demo, temperature, seed):
    r = openai_client(demo, timeout=300).chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS,
        tool_choice="required",
        temperature=temperature,
        seed=seed,
        max_tokens=200,
    )
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    tool = {t["function"]["name"]: t for t in TOOLS}[calls[0].function.name]
    jsonschema.validate(json.loads(calls[0].function.arguments), tool["function"]["parameters"])


def test_named_tool_choice(demo):
    r = openai_client(demo, timeout=300).chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        temperature=0,
        max_tokens=200,
    )
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["add"]
    jsonschema.validate(json.loads(calls[0].function.arguments), TOOLS[1]["function"]["parameters"])


def test_concurrent_mixed_constraints(demo):
    def constrained(i: int) -> None:
        jsonschema.validate(ask_schema(demo, SCHEMAS[i], 0.0), SCHEMAS[i])

    def free() -> str:
        r = openai_client(demo, timeout=300).chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=30,
        )
        return r.choices[0].message.content

    with ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(constrained, i) for i in (0, 1, 2, 4)] + [pool.submit(free)]
        results = [f.result() for f in futures]
    assert "Paris" in results[-1]


@pytest.mark.parametrize(
    "response_format,needle",
    [
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
            },
            "uniqueItems",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
            "objekt",
        ),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": "not a schema"}}, "schema"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
    ],
)
def test_bad_schema_400(demo, response_format, needle):
    r = httpx.post(
        demo.base_url + "/v1/chat/completions",
        json=chat("x", response_format=response_format),
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_tool_choice_errors(demo):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(demo.base_url + "/v1/chat/completions", json={**body, "tool_choice": "required"})
    assert r.status_code == 400 and "no tools" in r.json()["error"]["message"]
    r = httpx.post(
        demo.base_url + "/v1/chat/completions",
        json={
            **body,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
    )
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"]
