"""Checks of request parameters that need the model: valid in the protocol, but not for
every vocabulary."""

from __future__ import annotations

from mlx_server.errors import InvalidRequest
from mlx_server.types import SamplingParams


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
