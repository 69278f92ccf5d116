"""What chat and text completions requests share: the sampling fields, stop strings and
streaming options of the body, and the neutral sampling settings they come to."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mlx_server.errors import InvalidRequest
from mlx_server.registry.keep_alive import KeepAliveField
from mlx_server.types import SamplingParams


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Model):
    include_usage: bool = False


class SamplingFields(_Model):
    """What chat and text completions requests share: sampling, stop strings, streaming."""

    model: str = ""
    # Several models: how long the named one stays loaded after this request (Ollama's
    # keep_alive, checked where models load).
    keep_alive: KeepAliveField = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    # A signed or unsigned 64-bit integer (OpenAI documents int64).
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 64)
    n_predict: int | None = None
    ignore_eos: bool | None = None  # llama.cpp's: generate max_tokens whatever the model says
    # Token id (as a JSON key) → bias added to its logit, in [-100, 100].
    logit_bias: dict[str, float] | None = None
    n: int | None = Field(default=None, ge=1)  # at most --max-n (checked by the route)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop strings are allowed")
        return v


def sampling_params(body: Any) -> SamplingParams:
    """OpenAI's sampling fields (chat and text completions share them), 0.7 by default."""
    return SamplingParams(
        temperature=0.7 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=body.seed,
        logit_bias=logit_bias(body.logit_bias),
    )


LOGIT_BIAS_LIMIT = 100.0


def logit_bias(raw: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` map as sorted (token id, bias) pairs; a key that is not a
    token id or a bias outside [-100, 100] is refused, naming the key. Whether the ids are
    in the model's vocabulary is checked where the vocabulary is known."""
    pairs: dict[int, float] = {}
    for key, value in (raw or {}).items():
        where = f"logit_bias.{key}"
        token = key.strip()
        if not token.isdigit() or not token.isascii():
            raise InvalidRequest(
                f"{where}: logit_bias keys must be token ids (non-negative integers)", param=where
            )
        if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise InvalidRequest(
                f"{where}: the bias must be between -100 and 100; got {value}", param=where
            )
        if value:
            pairs[int(token)] = float(value)
    return tuple(sorted(pairs.items()))
