"""Speculative decoding: drafters propose tokens, the target model verifies them in one pass.

- ``drafters``: where proposals come from (prompt lookup, a predicted output, a draft model).
- ``verify``: one forward pass of the target over a draft, acceptance, and rollback of the
  rejected positions in the KV cache.
- ``controller``: how many tokens to draft next, from measured acceptance and step cost.
- ``sequence``: a lone sequence that speculates (the lone-request runner's counterpart).
- ``kinds``: the drafter kinds ``--draft-kind`` names.

The package imports nothing at import time, so the CLI can check flags without MLX.
"""
