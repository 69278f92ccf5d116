"""Speculative decoding: drafters propose tokens, the target model verifies them in one pass.

- ``drafters``: where proposals come from (prompt lookup, a predicted output, a draft model).
- ``verify``: one forward pass of the target over a draft, acceptance, and rollback of the
  rejected positions in the KV cache.
- ``rejection``: rejection sampling against a draft model's own probabilities.
- ``controller``: how many tokens to draft next, from measured acceptance and step cost;
  for a lone sequence and for a batch. ``costs``: the verify passes' widths and their
  measured costs; ``shadow``: cheap drafts scored on plain steps, never verified;
  ``plan_log``: the plan's decisions, counted.
- ``sequence`` and ``runner``: a lone sequence that speculates (the lone-request runner's
  counterpart).
- ``batch``, ``batch_verify`` and ``batch_runner``: speculation inside continuous batching
  (mlx-lm's decode batch verifies every row's draft in one pass, rolled back per row).
- ``kinds``: the drafter kinds ``--draft-kind`` names.

The package imports nothing at import time, so the CLI can check flags without MLX.
"""
