"""What a chat template expects from the caller, found by rendering it once at load.

Templates disagree on two shapes that OpenAI-style requests leave open (llama.cpp detects the
same facts with probe renders, in its template capabilities):

- Tool-call ``arguments``: most templates iterate an object or pipe it through ``tojson``;
  others concatenate a JSON string (``'...' + tool_call.arguments``: functionary v3.2,
  DeepSeek V3.1), which fails on an object.
- An assistant turn that only calls tools: some templates render the calls only when its
  ``content`` is None (DeepSeek R1: ``message['content'] is none``), and silently drop them
  when it is an empty string.

The probes render a short conversation with a tool call in each shape and look for the
call's name and argument in the output. Others find templates that refuse a system message,
ignore tool results, need 9-character call ids (Mistral), bare tool objects (Apertus),
descriptions on every tool and parameter, or a calling turn with text or reasoning but not
both (gpt-oss).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_NAME = "probe_tool"
_KEY = "probe_key"
_VALUE = "probe_value"
_RESULT = "probe result"
# Call ids of 9 letters and digits suit every template (Mistral's require exactly that).
_ID = "probe0abc"
_LONG_ID = "call_probe0abc"
_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": _NAME,
            "description": "A probe.",
            "parameters": {"type": "object", "properties": {_KEY: {"type": "string"}}},
        },
    }
]


@dataclass(frozen=True)
class TemplateCaps:
    """Caller-side shapes a template needs."""

    # Tool-call arguments as a JSON string rather than an object.
    string_arguments: bool = False
    # An assistant turn with tool calls and no text keeps content None (not "").
    null_content_with_calls: bool = False
    # Tools as bare function objects ({"name", "description", "parameters"}), not wrapped in
    # {"type": "function", "function": ...} (Apertus).
    flat_tools: bool = False
    # The template refuses a system message (Gemma 2): its text goes into the first user turn.
    merge_system: bool = False
    # The template does not show tool results (no tool role): they go into user turns.
    tool_results_as_user: bool = False
    # Call ids must be 9 letters and digits (Mistral): longer ones are shortened, the same
    # way in the call and in its result.
    short_call_ids: bool = False
    # A tool-calling turn may carry text or reasoning, not both (gpt-oss): the text is
    # appended to the reasoning.
    text_into_reasoning: bool = False
    # Tools and their parameters need a description (gpt-oss, Command R+ concatenate it):
    # missing ones are given as empty text.
    tool_descriptions: bool = False


Render = Callable[..., str]


def _conversation(
    arguments: Any, content: str | None, *, tool_reply: bool, call_id: str = _ID
) -> list[dict[str, Any]]:
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": _NAME, "arguments": arguments},
    }
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Probe question"},
        {"role": "assistant", "content": content, "tool_calls": [call]},
    ]
    if tool_reply:
        messages.append({"role": "tool", "tool_call_id": call_id, "content": _RESULT})
    return messages


def _try(render: Render, messages: list[dict[str, Any]], tools: Any) -> str | None:
    try:
        return render(messages, tools=tools, add_generation_prompt=True)
    except Exception:
        return None


def _shows(out: str | None, text: str) -> bool:
    return out is not None and text in out


def _shows_object(out: str | None) -> bool:
    # The key must appear, and not as a Python dict's repr (a template that prints the value
    # as is expects a string).
    return out is not None and _KEY in out and f"'{_KEY}'" not in out


def probe_template(render: Render) -> TemplateCaps:
    """Probe a template through ``render(messages, tools=..., add_generation_prompt=...)``,
    which must render messages as given (no normalisation)."""
    flat = _needs_flat_tools(render)
    tools: list[dict[str, Any]] = [t["function"] for t in _TOOLS] if flat else _TOOLS
    string_arguments, null_content = _probe_calls(render, tools)
    arguments: Any = {_KEY: _VALUE}
    if string_arguments:
        arguments = json.dumps(arguments)
    reply = _conversation(arguments, None if null_content else "", tool_reply=True)
    long_reply = _conversation(
        arguments, None if null_content else "", tool_reply=True, call_id=_LONG_ID
    )
    shows_reply = _shows(_try(render, reply, tools), _RESULT)
    return TemplateCaps(
        short_call_ids=shows_reply and _try(render, long_reply, tools) is None,
        string_arguments=string_arguments,
        null_content_with_calls=null_content,
        flat_tools=flat,
        merge_system=_refuses_system(render),
        tool_results_as_user=not shows_reply,
        text_into_reasoning=_refuses_text_with_reasoning(render, reply, tools),
        tool_descriptions=_needs_descriptions(render, flat),
    )


def _needs_descriptions(render: Render, flat: bool) -> bool:
    user = [{"role": "user", "content": "Probe question"}]
    bare: list[dict[str, Any]] = [
        {
            "type": "function",
            "function": {
                "name": _NAME,
                "parameters": {"type": "object", "properties": {_KEY: {"type": "string"}}},
            },
        }
    ]
    described = [fill_descriptions(t) for t in bare]
    if flat:
        bare, described = [t["function"] for t in bare], [t["function"] for t in described]
    return _try(render, user, bare) is None and _try(render, user, described) is not None


def fill_descriptions(tool: dict[str, Any]) -> dict[str, Any]:
    """The tool with an empty ``description`` wherever the function or a parameter lacks one."""
    function = tool.get("function")
    if not isinstance(function, dict):
        return tool
    function = {"description": "", **function}
    params = function.get("parameters")
    if isinstance(params, dict) and isinstance(params.get("properties"), dict):
        props = {
            k: {"description": "", **v} if isinstance(v, dict) else v
            for k, v in params["properties"].items()
        }
        function["parameters"] = {**params, "properties": props}
    return {**tool, "function": function}


def _refuses_text_with_reasoning(
    render: Render, reply: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> bool:
    thought = {"reasoning_content": "Probe thought", "thinking": "Probe thought"}
    alone = [reply[0], {**reply[1], **thought}, *reply[2:]]
    both = [reply[0], {**reply[1], **thought, "content": "Probe text"}, *reply[2:]]
    return _try(render, alone, tools) is not None and _try(render, both, tools) is None


def _needs_flat_tools(render: Render) -> bool:
    user = [{"role": "user", "content": "Probe question"}]
    if _shows(_try(render, user, _TOOLS), _NAME):
        return False
    return _shows(_try(render, user, [t["function"] for t in _TOOLS]), _NAME)


def _refuses_system(render: Render) -> bool:
    user = {"role": "user", "content": "Probe question"}
    system = {"role": "system", "content": "Probe system"}
    return _try(render, [system, user], None) is None and _try(render, [user], None) is not None


def _probe_calls(render: Render, tools: list[dict[str, Any]]) -> tuple[bool, bool]:
    """(string arguments, null content).

    The first shape, in order of preference (object arguments, empty content), whose render
    shows the call's argument wins; a template that shows none gets the defaults.
    """
    as_object = {_KEY: _VALUE}
    as_string = json.dumps(as_object)
    shapes = [(False, ""), (True, ""), (False, None), (True, None)]
    for tool_reply in (True, False):
        found = False
        for string_arguments, content in shapes:
            arguments = as_string if string_arguments else as_object
            out = _try(render, _conversation(arguments, content, tool_reply=tool_reply), tools)
            found = found or out is not None
            shown = _shows(out, _KEY) if string_arguments else _shows_object(out)
            if shown:
                return string_arguments, content is None
        if found:
            break  # the template renders this conversation, just never shows the call
    return False, False
