"""OpenAI Responses API request schema, validated at the edge. Unknown fields are ignored.

Input items and tools stay loosely typed here: the adapter checks them one by one so that
each error names its place (``input[2].content[1]``, ``tools[0].type``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mlx_server.protocols.fields import ToolChoiceField
from mlx_server.registry.keep_alive import KeepAliveField


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextFormat(_Model):
    type: str = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Model):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(_Model):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None


class CreateResponseRequest(_Model):
    model: str = ""
    # Several models: how long the named one stays loaded after this request (Ollama's
    # keep_alive, checked where models load).
    keep_alive: KeepAliveField = None
    input: str | list[Any] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: ToolChoiceField = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    ignore_eos: bool | None = None  # llama.cpp's, as on chat completions: max tokens always
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None
    stream: bool = False
    previous_response_id: str | None = None
    background: bool | None = None
    truncation: str | None = None

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None and len(v) > 16:
            raise ValueError("metadata may hold at most 16 keys")
        return v
