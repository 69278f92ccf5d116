"""Reasoning effort requested by the caller, as chat-template variables.

gpt-oss's template reads ``reasoning_effort`` (``low``, ``medium``, ``high``; it writes
``Reasoning: <level>`` into the system message). Templates with an on/off switch read
``enable_thinking``. OpenAI's ``reasoning_effort`` and Anthropic's ``thinking`` /
``output_config.effort`` both become these variables; a template ignores the ones it does
not read.
"""

from __future__ import annotations

from typing import Any

LEVELS = ("low", "medium", "high")
# OpenAI's other effort names, mapped onto the three levels gpt-oss knows.
_ALIASES = {"none": "low", "minimal": "low", "xhigh": "high", "max": "high"}


def effort_level(value: str) -> str | None:
    """One of ``LEVELS`` for an effort name, or None when the name is unknown."""
    name = value.strip().lower()
    return name if name in LEVELS else _ALIASES.get(name)


def effort_from_budget(budget_tokens: int | None) -> str:
    """A level for Anthropic's thinking budget (none given: the template's default)."""
    if budget_tokens is None:
        return "medium"
    if budget_tokens < 4096:
        return "low"
    return "medium" if budget_tokens < 16384 else "high"


def effort_kwargs(effort: str) -> dict[str, Any]:
    """Template variables for a requested effort (``none`` also turns thinking off)."""
    level = effort_level(effort)
    if level is None:
        raise ValueError(
            f"reasoning_effort must be one of none, minimal, low, medium, high, xhigh (got {effort!r})"
        )
    kwargs: dict[str, Any] = {"reasoning_effort": level}
    if effort.strip().lower() == "none":
        kwargs["enable_thinking"] = False
    return kwargs
