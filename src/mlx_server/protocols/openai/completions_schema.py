"""OpenAI legacy Completions request schema (``POST /v1/completions``). Unknown fields are
ignored, as on chat completions."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mlx_server.protocols.openai.schemas import StreamOptions


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = ""
    # Text, a batch of texts, token ids, or a batch of token-id lists.
    prompt: str | list[str] | list[int] | list[list[int]]
    suffix: str | None = None
    max_tokens: int | None = Field(default=16, ge=0)
    n_predict: int | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 64)  # int64 or uint64
    n: int | None = Field(default=None, ge=1, le=1)
    best_of: int | None = Field(default=None, ge=1, le=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop strings are allowed")
        return v

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("the prompt list is empty")
        if isinstance(v, list) and any(isinstance(p, list) and not p for p in v):
            raise ValueError("a token-id prompt is empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a batch: one entry per choice."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]
