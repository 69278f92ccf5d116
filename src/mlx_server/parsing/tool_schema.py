"""Validation of tool definitions (OpenAI ``tools`` form) before they reach a template."""

from __future__ import annotations

from typing import Any


def validate_tools(tools: object) -> list[dict[str, Any]]:
    """Check a ``tools`` list and return it; ``ValueError`` names the first bad entry.

    Each entry must be ``{"type": "function", "function": {"name": str, ...}}`` where
    ``description``, if present, is a string and ``parameters``, if present and not null, is
    a JSON object. Anything inside a schema is left alone: ``null`` values there are valid.
    """
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list, got {_kind(tools)}")
    for i, tool in enumerate(tools):
        problem = _entry_problem(tool)
        if problem:
            raise ValueError(f"tools[{i}]: {problem}")
    return tools


def tool_names(tools: list[dict[str, Any]] | None) -> set[str]:
    """Names of the functions in a (valid) tools list."""
    names = set()
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.add(function["name"])
    return names


def _entry_problem(tool: object) -> str | None:
    if not isinstance(tool, dict):
        return f"must be an object, got {_kind(tool)}"
    kind = tool.get("type", "function")
    if kind != "function":
        return f"unsupported type {kind!r} (only 'function')"
    function = tool.get("function")
    if not isinstance(function, dict):
        return f"'function' must be an object, got {_kind(function)}"
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        return "'function.name' must be a non-empty string"
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        return f"'function.description' must be a string, got {_kind(description)}"
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        return f"'function.parameters' must be an object, got {_kind(parameters)}"
    return None


def _kind(value: object) -> str:
    """The JSON name of a value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__
