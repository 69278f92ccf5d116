"""Rank 0's messages to the other ranks, carried by MLX's own collectives.

A message is bytes. Every rank takes part in an ``all_sum`` of a fixed-size block: rank 0's
holds the message's length and its first bytes, the others' are zeros, so the sum is rank 0's
block on every rank (the way mlx-lm's server shares its requests). A longer message takes a
second ``all_sum`` for the rest. The sums run on mlx-lm's generation stream, where the model's
own collectives (tensor-parallel sums, pipeline hand-overs) run too: one stream runs its work
in order, so every rank meets the collectives in the same order.

Evaluation blocks: a rank that is gone makes the ring raise here (or hang, which the watch
catches), instead of failing a later step half-computed.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

BLOCK = 4096  # bytes per message carried by the first sum (a step's message fits easily)
_LEN = 4  # the length's bytes at the start of the block


class Channel:
    """Rank 0 sends, every other rank receives, each message in the same order."""

    def __init__(self, group: Any):
        self.group = group
        self.rank = int(group.rank())

    def _sum(self, data: np.ndarray) -> np.ndarray:
        from mlx_lm.generate import generation_stream

        with mx.stream(generation_stream):
            out = mx.distributed.all_sum(mx.array(data), group=self.group)
            mx.eval(out)
        return np.array(out, copy=False)

    def send(self, message: bytes) -> None:
        """Rank 0: deliver ``message`` to every other rank."""
        assert self.rank == 0, "only rank 0 sends"
        n = len(message)
        block = np.zeros(BLOCK, dtype=np.uint8)
        block[:_LEN] = np.frombuffer(n.to_bytes(_LEN, "little"), dtype=np.uint8)
        head = message[: BLOCK - _LEN]
        block[_LEN : _LEN + len(head)] = np.frombuffer(head, dtype=np.uint8)
        self._sum(block)
        if n > BLOCK - _LEN:
            self._sum(np.frombuffer(message[BLOCK - _LEN :], dtype=np.uint8))

    def receive(self) -> bytes:
        """Any other rank: the next message rank 0 sent."""
        block = self._sum(np.zeros(BLOCK, dtype=np.uint8))
        n = int.from_bytes(block[:_LEN].tobytes(), "little")
        head = block[_LEN : _LEN + min(n, BLOCK - _LEN)].tobytes()
        if n <= BLOCK - _LEN:
            return head
        rest = self._sum(np.zeros(n - (BLOCK - _LEN), dtype=np.uint8))
        return head + rest.tobytes()
