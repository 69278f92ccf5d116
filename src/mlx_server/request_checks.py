"""Checks of request parameters that need the model: valid in the protocol, but not for
every vocabulary, or not for a model that takes text only."""

from __future__ import annotations

from mlx_server.errors import InvalidRequest
from mlx_server.types import ChatRequest, SamplingParams


def check_text_only(chat: ChatRequest, model_id: str) -> None:
    """Refuse media parts for a text-only model (a server that also serves a vision model
    lets its protocols take them), naming the first."""
    for m in chat.messages:
        content = m.get("content")
        for part in content if isinstance(content, list) else []:
            if part.get("type") != "text":
                where = part.get("param") or "messages"
                raise InvalidRequest(
                    f"{where} is an {part.get('type')} part, but model '{model_id}' accepts "
                    "text only",
                    param=where,
                )


def check_logit_bias(sampling: SamplingParams, vocab_size: int) -> None:
    """Refuse a ``logit_bias`` on a token id the model does not have (0: vocabulary
    unknown, nothing to check against)."""
    if not vocab_size:
        return
    for token, _ in sampling.logit_bias:
        if token >= vocab_size:
            where = f"logit_bias.{token}"
            raise InvalidRequest(
                f"{where}: token id {token} is outside the model's vocabulary "
                f"(ids 0 to {vocab_size - 1})",
                param=where,
            )
