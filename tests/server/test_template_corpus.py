"""Every vendored chat template through the real HTTP stack and ChatService.

For each template (tests/data/templates), requests of every common shape — plain chat,
tools, a tool round trip in the history, reasoning in the history, template kwargs,
streaming, and the Anthropic API — answer 200, or a 400 quoting the template's own
``raise_exception`` message where the template refuses that shape (listed in REFUSED). The
rendered prompt is checked for what the template must show: the tools, the earlier call and
its result, and no ``None`` leaking from a null field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from payloads import WEATHER, anthropic_tool, anthropic_tool_round_trip, openai_tool_round_trip
from scripted_engine import ScriptedEngine
from starlette.testclient import TestClient
from template_corpus import load_tokenizer, raise_messages, template_files, tokenizer_dir

from mlx_server.boot.app import create_app
from mlx_server.service import ChatService

SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "What is the weather in Paris?"}
ROUND_TRIP = [
    SYSTEM,
    USER,
    *openai_tool_round_trip(
        "get_weather",
        '{"city": "Paris"}',
        "18 degrees and sunny",
        call_id="call_a1b2c3d4e5f6a7b8c9d0e1f2",
    ),
    {"role": "user", "content": "And tomorrow?"},
]
REASONING = [
    USER,
    {
        "role": "assistant",
        "content": "It is sunny in Paris.",
        "reasoning_content": "The user wants the weather.",
    },
    {"role": "user", "content": "Thanks. And in Rome?"},
]

# shape -> (request body fields, texts the rendered prompt must contain)
SHAPES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "plain": ({"messages": [SYSTEM, USER]}, ["You are terse.", "weather in Paris"]),
    "user_only": ({"messages": [USER]}, ["weather in Paris"]),
    "tools": ({"messages": [SYSTEM, USER], "tools": [WEATHER]}, ["get_weather"]),
    "round_trip": (
        {"messages": ROUND_TRIP, "tools": [WEATHER]},
        ["get_weather", "Paris", "18 degrees and sunny", "And tomorrow?"],
    ),
    "after_tool": (
        {"messages": ROUND_TRIP[:4], "tools": [WEATHER]},
        ["get_weather", "Paris", "18 degrees and sunny"],
    ),
    "reasoning_history": ({"messages": REASONING}, ["It is sunny in Paris.", "in Rome?"]),
    "no_thinking": (
        {"messages": [USER], "chat_template_kwargs": {"enable_thinking": False}},
        ["weather in Paris"],
    ),
    "stream_tools": (
        {"messages": [SYSTEM, USER], "tools": [WEATHER], "stream": True},
        ["get_weather"],
    ),
}

ANTHROPIC_ROUND_TRIP = {
    "max_tokens": 16,
    "system": "You are terse.",
    "tools": [anthropic_tool(WEATHER)],
    "messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        *anthropic_tool_round_trip(
            "get_weather",
            {"city": "Paris"},
            "18 degrees and sunny",
            call_id="toolu_01",
            after=({"type": "text", "text": "And tomorrow?"},),
        ),
    ],
}

# (template file stem, shape) -> the template's own message refusing that request shape.
_ALTERNATE = "conversation roles must alternate user/assistant/user/assistant/..."
REFUSED: dict[tuple[str, str], str] = {
    # Mistral's templates want the assistant to answer a tool result before the user speaks.
    ("Mistral-Small-3.2-24B-Instruct-2506", "round_trip"): _ALTERNATE,
    ("Mistral-Small-3.2-24B-Instruct-2506", "anthropic_round_trip"): _ALTERNATE,
    ("mistralai-Mistral-Nemo-Instruct-2407", "round_trip"): _ALTERNATE,
    ("mistralai-Mistral-Nemo-Instruct-2407", "anthropic_round_trip"): _ALTERNATE,
}

TEMPLATE_FILES = template_files()


def test_corpus_is_real_text():
    """Vendored templates are the files themselves, not Git LFS pointers."""
    assert len(TEMPLATE_FILES) >= 30
    for path in TEMPLATE_FILES:
        text = path.read_text(encoding="utf-8")
        assert not text.startswith("version https://git-lfs"), path.name
        assert "{%" in text or "{{" in text, path.name
    provenance = (TEMPLATE_FILES[0].parent / "PROVENANCE.md").read_text()
    for path in TEMPLATE_FILES:
        assert path.name in provenance, path.name


@pytest.fixture(scope="module")
def corpus_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("template-corpus")


def _client(root: Path, template: Path) -> tuple[TestClient, ScriptedEngine, Any]:
    tokenizer = load_tokenizer(tokenizer_dir(root, template))
    engine = ScriptedEngine()
    service = ChatService("corpus", tokenizer, engine, ctx_size=8192)
    return TestClient(create_app(service), base_url="http://localhost"), engine, tokenizer


def _check_refusal(name: str, shape: str, status: int, body: dict, source: str) -> None:
    expected = REFUSED.get((name, shape))
    if expected is None:
        assert status == 200, f"{name} {shape}: {status} {body}"
        return
    assert status == 400, f"{name} {shape}: expected the template's refusal, got {status}"
    message = body["error"]["message"] if "error" in body else body
    assert expected in message, message
    assert expected in raise_messages(source) or any(expected in m for m in raise_messages(source))


def _prompt(engine: ScriptedEngine, tokenizer: Any) -> str:
    return tokenizer.decode(engine.requests[-1].prompt_tokens)


def _sse_frames(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("template", TEMPLATE_FILES, ids=lambda p: p.stem)
def test_template_serves_every_shape(template: Path, corpus_root: Path):
    source = template.read_text(encoding="utf-8")
    client, engine, tokenizer = _client(corpus_root, template)
    name = template.stem
    with client:
        for shape, (fields, shown) in SHAPES.items():
            body = {"model": "m", "max_tokens": 8, "temperature": 0, **fields}
            before = len(engine.requests)
            r = client.post("/v1/chat/completions", json=body)
            if fields.get("stream") and r.status_code == 200:
                frames = _sse_frames(r.text)
                assert frames[-1] == "[DONE]", f"{name} {shape}: {frames[-3:]}"
                chunks = [json.loads(f) for f in frames[:-1]]
                assert not any("error" in c for c in chunks), f"{name} {shape}: {chunks}"
                assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
                payload: dict = {}
            else:
                payload = r.json()
            _check_refusal(name, shape, r.status_code, payload, source)
            if r.status_code != 200:
                assert len(engine.requests) == before
                continue
            prompt = _prompt(engine, tokenizer)
            for text in shown:
                assert text in prompt, f"{name} {shape}: {text!r} missing from the prompt"
            assert "None" not in prompt, f"{name} {shape}: a null field rendered as None"
            if not fields.get("stream"):
                message = payload["choices"][0]["message"]
                said = (message.get("content") or "") + (message.get("reasoning_content") or "")
                assert "Hello there!" in said, f"{name} {shape}: {message}"
        r = client.post("/v1/messages", json={"model": "m", **ANTHROPIC_ROUND_TRIP})
        _check_refusal(name, "anthropic_round_trip", r.status_code, r.json(), source)
        if r.status_code == 200:
            prompt = _prompt(engine, tokenizer)
            for text in ("get_weather", "Paris", "18 degrees and sunny", "And tomorrow?"):
                assert text in prompt, f"{name} anthropic: {text!r} missing from the prompt"
            assert r.json()["type"] == "message"
