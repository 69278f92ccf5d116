"""OpenAI Chat Completions request schema, validated at the edge. Unknown fields are ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mlx_server.protocols.fields import ToolChoiceField
from mlx_server.protocols.openai.sampling import SamplingFields


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionCall(_Model):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ImageURL(_Model):
    url: str
    detail: str | None = None


class ContentPart(_Model):
    type: str
    text: str | None = None
    image_url: ImageURL | str | None = None
    input_audio: Any = None
    video_url: Any = None


class Message(_Model):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    # Jan's legacy per-message media fields.
    images: list[str] | None = None
    videos: list[str] | None = None


class ResponseFormat(_Model):
    type: str = "text"
    json_schema: dict[str, Any] | None = None


class PredictionPart(_Model):
    type: Literal["text"]
    text: str


class Prediction(_Model):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat (a file being
    edited), drafted for speculative decoding."""

    type: Literal["content"]
    content: str | list[PredictionPart]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: ToolChoiceField = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's chat-template controls (see the adapter's ``template_controls``).
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    reasoning_format: str | None = None
    reasoning_effort: str | None = None
    prediction: Prediction | None = None

    @field_validator("reasoning_format")
    @classmethod
    def _check_reasoning_format(cls, v: str | None) -> str | None:
        if v is not None and v not in ("none", "auto", "deepseek", "deepseek-legacy"):
            raise ValueError("reasoning_format must be 'auto' or 'none'")
        return v
