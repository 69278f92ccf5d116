"""Ollama request bodies → neutral requests, and the NDJSON framer (no server)."""

from __future__ import annotations

import json

import pytest

from mlx_server.errors import InvalidRequest
from mlx_server.protocols.ollama.adapter import (
    generate_chat_request,
    response_format,
    text_options,
    think_kwargs,
    to_chat_request,
)
from mlx_server.protocols.ollama.schemas import ChatBody, GenerateBody
from mlx_server.server.framing import ndjson_line
from mlx_server.server.sse import Frame, RawJSON

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGBgAAAABQABpfZFQAAAAABJRU5ErkJggg=="


def test_think_maps_to_the_templates_switches():
    assert think_kwargs(None) == {}
    assert think_kwargs(True) == {"enable_thinking": True}
    assert think_kwargs(False) == {"enable_thinking": False, "reasoning_effort": "low"}
    assert think_kwargs("high") == {"reasoning_effort": "high"}


def test_format_maps_to_the_neutral_response_format():
    schema = {"type": "object"}
    assert response_format(None) is None and response_format("") is None
    assert response_format("json") == {"type": "json_object"}
    assert response_format(schema) == {"type": "json_schema", "schema": schema}


def test_messages_tool_calls_and_images():
    body = ChatBody.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "look", "images": [PNG]},
                {
                    "role": "assistant",
                    "content": "",
                    "thinking": "hmm",
                    "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}],
                },
                {"role": "tool", "content": "42", "tool_name": "f"},
            ],
        }
    )
    chat = to_chat_request(body, vision=True)
    user, assistant, tool = chat.messages
    assert user["content"][0]["image"].startswith("data:image/png;base64,iVBOR")
    assert user["content"][-1] == {"type": "text", "text": "look"}
    assert assistant["tool_calls"][0]["function"] == {"name": "f", "arguments": {"a": 1}}
    assert assistant["reasoning_content"] == "hmm"
    assert tool == {"role": "tool", "content": "42", "name": "f"}
    with pytest.raises(InvalidRequest, match=r"messages\[0\]\.images"):
        to_chat_request(body, vision=False)


def test_generate_prompt_and_raw_options():
    body = GenerateBody.model_validate(
        {"model": "m", "prompt": "p", "system": "s", "options": {"num_predict": -1, "stop": "x"}}
    )
    chat = generate_chat_request(body, vision=False)
    assert chat.messages == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "p"},
    ]
    assert chat.max_tokens is None and chat.stop == ("x",)
    opts = text_options(body)
    assert opts.max_tokens == 128 and opts.top_logprobs is None


def test_ndjson_lines():
    assert ndjson_line(Frame({"a": "é"})) == '{"a": "é"}\n'.encode()
    assert ndjson_line(Frame(RawJSON(b'{"b":1}'))) == b'{"b":1}\n'
    assert json.loads(ndjson_line(Frame(error="boom"))) == {"error": "boom"}
    assert ndjson_line(Frame(comment="keep-alive")) == b""
