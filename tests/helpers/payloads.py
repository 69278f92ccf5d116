"""Request pieces the tests send again and again: the weather and time tools in each API's
shape, the tool call a scripted model makes, and closed JSON-object schemas."""

from __future__ import annotations

from typing import Any


def chat(content: str = "hi", **fields: Any) -> dict[str, Any]:
    """A chat-completions body: one user message to model "m", then ``fields``."""
    return {"model": "m", "messages": [{"role": "user", "content": content}], **fields}


# The weather tool, OpenAI's chat shape (Ollama's too).
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

# A second tool, for turns that call two.
TIME: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Time in a zone.",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
    },
}

# What a Hermes/Qwen-style model writes to call the weather tool for Paris.
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def anthropic_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI chat tool in the Anthropic Messages API's shape."""
    fn = tool["function"]
    return {"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}


def responses_tool(tool: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """An OpenAI chat tool in the Responses API's flat shape."""
    return {"type": "function", **tool["function"], **extra}


def closed_object(properties: dict[str, Any], required: list[str] | None = None) -> dict:
    """A JSON-object schema that requires every property (unless told which) and allows no
    other: the shape strict structured output needs."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


def anthropic_tool_round_trip(
    name: str,
    arguments: dict[str, Any],
    result: Any,
    *,
    call_id: str = "toolu_1",
    before: tuple[dict, ...] = (),
    after: tuple[dict, ...] = (),
) -> list[dict]:
    """A tool round trip in the Messages API's history: the assistant's turn (``before``
    blocks, such as thinking and text, then the ``tool_use``) and the user's turn (the
    ``tool_result``, then ``after`` blocks)."""
    use = {"type": "tool_use", "id": call_id, "name": name, "input": arguments}
    back = {"type": "tool_result", "tool_use_id": call_id, "content": result}
    return [
        {"role": "assistant", "content": [*before, use]},
        {"role": "user", "content": [back, *after]},
    ]


def openai_tool_round_trip(
    name: str, arguments: str, result: str, *, call_id: str = "call_1", **assistant: Any
) -> list[dict]:
    """A tool round trip in a chat-completions history: the assistant's turn calling the tool
    (``arguments`` as the JSON text the API carries; ``assistant`` adds fields such as
    ``reasoning_content``) and the tool's answer."""
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
    return [
        {"role": "assistant", "content": None, **assistant, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ]
