"""Anthropic Messages request schema, validated at the edge.

Unknown fields are ignored (``cache_control``, ``metadata``, ``service_tier``, ``citations``
...). Message content blocks are kept as raw objects here and validated one by one with
``BLOCK_MODELS`` by the adapter, so each error names the exact block it is about.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mlx_server.registry.keep_alive import KeepAliveField


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---- content blocks ----------------------------------------------------------------------


class TextBlock(_Model):
    type: Literal["text"]
    text: str


class ImageSource(_Model):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(_Model):
    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(_Model):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Model):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Model):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Model):
    type: Literal["redacted_thinking"]
    data: str | None = None


Block = (
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
)

BLOCK_MODELS: dict[str, type[_Model]] = {
    "text": TextBlock,
    "image": ImageBlock,
    "tool_use": ToolUseBlock,
    "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock,
    "redacted_thinking": RedactedThinkingBlock,
}


# ---- request -----------------------------------------------------------------------------


class InputMessage(_Model):
    # "system": a system message within the conversation (the SDK's SystemMessageParam;
    # text only), rendered where it stands when the chat template allows it.
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class SystemBlock(_Model):
    type: Literal["text"]
    text: str


class ToolDefinition(_Model):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    # Absent or "custom" for client tools; server tools (web_search_..., bash_...) have others.
    type: str | None = None


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Model):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=1024)


class OutputConfig(_Model):
    effort: str | None = None
    format: dict[str, Any] | None = None


class CountTokensRequest(_Model):
    """The body of ``/v1/messages/count_tokens``: a Messages request without generation fields."""

    model: str
    # Several models: how long the named one stays loaded after this request (Ollama's
    # keep_alive, checked where models load).
    keep_alive: KeepAliveField = None
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[SystemBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    """The body of ``/v1/messages``."""

    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stop_sequences: list[str] | None = None
    ignore_eos: bool | None = None  # llama.cpp's, as on chat completions: max_tokens always
    stream: bool = Field(default=False, strict=True)
    metadata: dict[str, Any] | None = None
