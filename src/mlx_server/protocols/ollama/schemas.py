"""Request bodies of Ollama's API, as its docs (docs/api.md in github.com/ollama/ollama)
and the official clients' types (``ollama._types``) define them. Unknown fields are
accepted and listed in the ignored-fields header."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from mlx_server.registry.keep_alive import KeepAliveField

# "" (free text), "json" (any JSON value), or a JSON schema object.
Format = Literal["", "json"] | dict[str, Any]
# A bool, or a level for models that take one (gpt-oss).
Think = bool | Literal["low", "medium", "high"]


class Options(BaseModel):
    """The ``options`` a request may carry (Modelfile parameters). The ones the engine uses
    are declared; the rest (``num_gpu``, ``num_thread``, ``mirostat``, ...) are accepted and
    have no effect (docs/ollama.md lists them). Numbers the sampler could not use (NaN, an
    infinity, a repeat penalty not above 0) are refused: they would sample noise or fail the
    generation. A negative temperature is greedy, as in llama.cpp's sampler."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    num_ctx: StrictInt | None = None
    num_predict: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)  # a fraction of the likeliest's
    repeat_penalty: float | None = Field(default=None, gt=0)  # 1: none; logits divided by it
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: StrictInt | None = None
    stop: list[StrictStr] | StrictStr | None = None


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr
    arguments: dict[str, Any] | StrictStr = Field(default_factory=dict)


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    function: ToolCallFunction
    id: StrictStr | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: StrictStr
    content: StrictStr | None = ""
    images: list[StrictStr] | None = None
    thinking: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: StrictStr | None = None
    tool_call_id: StrictStr | None = None


class GenerationBody(BaseModel):
    """What /api/chat and /api/generate share."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    stream: bool = True
    format: Format | None = None
    options: Options | None = None
    keep_alive: KeepAliveField = None
    think: Think | None = None
    logprobs: bool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)  # as on /v1


class ChatBody(GenerationBody):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateBody(GenerationBody):
    prompt: StrictStr | None = None
    suffix: StrictStr | None = None
    system: StrictStr | None = None
    template: StrictStr | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[StrictStr] | None = None


class ModelBody(BaseModel):
    """/api/show; the model management routes (pull, delete, create, copy, push)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    model: StrictStr = Field(default="", alias="model")
    name: StrictStr | None = None  # the older clients' name for ``model``
    verbose: bool = False

    @property
    def model_name(self) -> str:
        return self.model or self.name or ""


class EmbedBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    input: StrictStr | list[StrictStr]
    truncate: bool = True
    options: Options | None = None
    keep_alive: KeepAliveField = None
    dimensions: StrictInt | None = None


class EmbeddingsBody(BaseModel):
    """The older /api/embeddings: one ``prompt``, one ``embedding``."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    prompt: StrictStr = ""
    options: Options | None = None
    keep_alive: KeepAliveField = None
