"""Request fields that several protocols' schemas declare alike."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator


def _check_tool_choice(v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(v, str) and v not in ("none", "auto", "required"):
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or a function object")
    return v


# OpenAI's ``tool_choice`` (chat completions, responses): a mode or a function object.
ToolChoiceField = Annotated[str | dict[str, Any] | None, AfterValidator(_check_tool_choice)]
