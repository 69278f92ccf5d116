"""OpenAI legacy Completions request schema (``POST /v1/completions``). Unknown fields are
ignored, as on chat completions."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from mlx_server.protocols.openai.sampling import SamplingFields


class CompletionRequest(SamplingFields):
    # Text, a batch of texts, token ids, or a batch of token-id lists.
    prompt: str | list[str] | list[int] | list[list[int]]
    suffix: str | None = None
    max_tokens: int | None = Field(default=16, ge=0)
    best_of: int | None = Field(default=None, ge=1, le=1)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)

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
