"""Speculative decoding: drafters propose tokens, the target model verifies them in one pass.

- ``drafters``: where proposals come from (prompt lookup, a predicted output, a draft model).
- ``verify``: one forward pass of the target over a draft, acceptance, and rollback of the
  rejected positions in the KV cache.
- ``acceptance``: rejection sampling for drafts that come with their own distribution.
- ``controller``: how many tokens to draft next, from measured acceptance and step cost.
- ``sequence``: a lone sequence that speculates (the lone-request runner's counterpart).
"""

from mlx_server.engine.speculative.drafters import (
    DraftModel,
    Drafter,
    PredictedOutput,
    PromptLookup,
    check_same_tokenizer,
)
from mlx_server.engine.speculative.verify import Verified, verify

__all__ = [
    "DraftModel",
    "Drafter",
    "PredictedOutput",
    "PromptLookup",
    "Verified",
    "check_same_tokenizer",
    "verify",
]
