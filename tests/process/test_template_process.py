"""Real server processes on tiny random-weight models carrying real chat templates: the
model loads, the template's probed shapes apply, and a few tokens are generated."""

from __future__ import annotations

import json

import httpx
import pytest
from payloads import openai_tool_round_trip
from support import free_port
from template_corpus import TEMPLATES, model_dir

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris?"},
    *openai_tool_round_trip(
        "get_weather", '{"city": "Paris"}', "18 degrees", call_id="call_0123456789abcdef01234567"
    ),
    {"role": "user", "content": "And tomorrow?"},
]


@pytest.mark.parametrize(
    "template",
    [
        "openai-gpt-oss-120b",
        "deepseek-ai-DeepSeek-V3.1",
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
    ],
)
def test_round_trip_on_a_real_process(template, tmp_path, server_factory):
    model = model_dir(tmp_path, TEMPLATES / f"{template}.jinja")
    port = free_port()
    server = server_factory(["-m", str(model), "--port", str(port), "--ctx-size", "4096"])
    base = server.base_url
    body = {
        "model": "m",
        "messages": ROUND_TRIP,
        "tools": TOOLS,
        "max_tokens": 3,
        "temperature": 0,
        "reasoning_effort": "low",
    }
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 3
    with httpx.stream(
        "POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=120
    ) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert not any("error" in json.loads(line[6:]) for line in lines[:-1])
    r = httpx.post(
        f"{base}/v1/messages/count_tokens",
        json={"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["input_tokens"] > 0
