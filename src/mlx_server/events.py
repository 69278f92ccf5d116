"""Neutral output events.

The engine produces raw text pieces; the output parsers (``mlx_server.parsing``) turn them
into these events; each protocol encoder maps them to its own wire format. Nothing here
knows about OpenAI or Anthropic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast, get_args


@dataclass(frozen=True)
class TextDelta:
    """A piece of the answer (``content`` / a ``text`` block)."""

    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """A piece of the model's reasoning (``reasoning_content`` / a ``thinking`` block)."""

    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A tool call begins. ``index`` counts calls in the response: 0, 1, 2, ..."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgsDelta:
    """A piece of the JSON text of a call's arguments; the pieces concatenate to a JSON object."""

    index: int
    text: str


@dataclass(frozen=True)
class ToolCallEnd:
    """A tool call is complete; ``arguments`` is its full JSON object text."""

    index: int
    arguments: str


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    bytes: list[int] | None = None


@dataclass(frozen=True)
class LogprobEntry:
    """The chosen token's log-probability and, if asked, the top alternatives."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    # Predicted Outputs: prediction tokens that the answer used / did not use (None: the
    # request had no prediction).
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Timings:
    """llama.cpp-style timings, in milliseconds."""

    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    cache_n: int = 0
    draft_n: int = 0  # tokens drafted by speculative decoding
    draft_n_accepted: int = 0  # of those, accepted

    @property
    def prompt_per_second(self) -> float:
        return self.prompt_n / (self.prompt_ms / 1000) if self.prompt_ms > 0 else 0.0

    @property
    def predicted_per_second(self) -> float:
        return self.predicted_n / (self.predicted_ms / 1000) if self.predicted_ms > 0 else 0.0


# Finish reasons, protocol-neutral:
#   "stop"          - end of sequence token
#   "stop_sequence" - a requested stop string matched (``stop_sequence`` names it)
#   "length"        - max_tokens or the context limit reached
#   "tool_calls"    - the answer ended with tool calls
#   "cancelled"     - cancelled by the client, /v1/cancel or shutdown
#   "error"         - an internal failure (``error`` holds the message)
# The engine sets them; the chat service alone turns "stop" into "tool_calls"; each protocol
# only translates them, through a table typed by this Literal.
FinishReason = Literal["stop", "stop_sequence", "length", "tool_calls", "cancelled", "error"]
FINISH_REASONS: frozenset[str] = frozenset(get_args(FinishReason))


def finish_reason(value: str) -> FinishReason:
    """A reason reported as text (mlx-lm's ``finish_reason``), checked."""
    if value not in FINISH_REASONS:
        raise ValueError(f"not a finish reason: {value!r}")
    return cast(FinishReason, value)


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    usage: Usage
    timings: Timings | None = None
    stop_sequence: str | None = None
    error: str | None = None
    # True when generation ended while still inside a reasoning block.
    in_reasoning: bool = False


OutputEvent = TextDelta | ReasoningDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd


@dataclass(frozen=True)
class Logprobs:
    """Log-probabilities of generated tokens, in order (only when the request asked)."""

    entries: tuple[LogprobEntry, ...]
