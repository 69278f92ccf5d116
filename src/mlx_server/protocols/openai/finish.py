"""How a chat or text completion ends, in OpenAI's words: its ``finish_reason``, ``usage``
and llama.cpp's ``timings``; and the frames every OpenAI stream shares."""

from __future__ import annotations

from typing import Any, Literal

from mlx_server.events import Finished, FinishReason, Timings, Usage
from mlx_server.server.sse import Frame

OpenAIFinish = Literal["stop", "length", "tool_calls"]
# OpenAI has no 'stop_sequence', 'cancelled' or 'error'.
FINISH_REASONS: dict[FinishReason, OpenAIFinish] = {
    "stop": "stop",
    "stop_sequence": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "cancelled": "stop",
    "error": "stop",
}


def finish_reason(ev: Finished) -> OpenAIFinish:
    """OpenAI's name for the neutral finish reason."""
    if ev.in_reasoning and ev.reason in ("stop", "stop_sequence", "length"):
        return "length"  # the answer never came: the reasoning was cut off
    return FINISH_REASONS[ev.reason]


def usage_json(u: Usage) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }
    if u.accepted_prediction_tokens is not None:
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": u.accepted_prediction_tokens,
            "rejected_prediction_tokens": u.rejected_prediction_tokens or 0,
        }
    return out


def timings_json(t: Timings) -> dict[str, Any]:
    out = {
        "cache_n": t.cache_n,
        "prompt_n": t.prompt_n,
        "prompt_ms": round(t.prompt_ms, 3),
        "prompt_per_second": round(t.prompt_per_second, 3),
        "predicted_n": t.predicted_n,
        "predicted_ms": round(t.predicted_ms, 3),
        "predicted_per_second": round(t.predicted_per_second, 3),
    }
    if t.draft_n:  # llama.cpp's names, there only when speculative decoding drafted
        out["draft_n"] = t.draft_n
        out["draft_n_accepted"] = t.draft_n_accepted
    return out


def total_usage(finals: list[Finished]) -> Usage:
    return Usage(
        sum(f.usage.prompt_tokens for f in finals),
        sum(f.usage.completion_tokens for f in finals),
        sum(f.usage.cached_tokens for f in finals),
    )


KEEPALIVE = Frame(comment="keep-alive")
DONE = Frame("[DONE]")
