"""A per-sequence logits processor that enforces an llguidance grammar.

It has mlx-lm's processor signature, ``processor(tokens, logits) -> logits``, so it plugs
into ``BatchGenerator.insert(logits_processors=[[processor], ...])`` and ``generate_step``.
``tokens`` is the sequence's context: its last element is the token sampled at the previous
step (on the first call, the last prompt token, which the grammar must not consume).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import llguidance
import mlx.core as mx
import numpy as np


class GrammarLogitsProcessor:
    """Masks every token the grammar does not allow next.

    Before ``activate_after`` appears at the end of the context the logits pass through
    unchanged (a reasoning block); from then on the grammar applies. Once the grammar is
    complete only the end-of-sequence tokens stay allowed. If the grammar breaks (it
    cannot, unless the sampler picks a masked token), ``error`` says why and only
    end-of-sequence tokens stay allowed, so the sequence ends instead of the batch failing.
    """

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        *,
        mask_vocab: int,
        eos_ids: Sequence[int],
        activate_after: Sequence[int] | None = None,
    ):
        self._matcher = matcher
        self._mask_words = (mask_vocab + 31) // 32
        self._eos_set = frozenset(eos_ids)
        self._eos_ids = np.asarray(sorted(self._eos_set), dtype=np.int64)
        self._trigger = tuple(activate_after or ())
        self._active = not self._trigger
        # The last context token on the call that activates the grammar was not sampled
        # under it (a prompt token or the trigger), so it is skipped, not consumed.
        self._skip_next = True
        self._bitmask: np.ndarray | None = None
        self.error: str | None = None
        self.consumed = 0

    @property
    def active(self) -> bool:
        """Whether the grammar applies yet (``activate_after`` has been seen)."""
        return self._active

    @property
    def accepting(self) -> bool:
        """Whether the tokens consumed so far are a complete match of the grammar.

        Each token is consumed on the call after it was sampled, so after a stop for
        length the last token is not yet counted.
        """
        return self._active and self._matcher.is_accepting()

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        # Start the forward pass now: reading the last token below waits for the previous
        # step, and the mask is then computed on the CPU while this step runs.
        mx.async_eval(logits)
        if not self._active:
            if not self._trigger_seen(tokens):
                return logits
            self._active = True
        if self._skip_next:
            self._skip_next = False
        elif self.error is None:
            self._consume(_tail(tokens, 1)[0])
        return _apply_mask(logits, self._next_allowed(logits.shape[-1]))

    def _trigger_seen(self, tokens: mx.array) -> bool:
        n = len(self._trigger)
        if tokens.shape[0] < n or _tail(tokens, 1)[0] != self._trigger[-1]:
            return False
        return n == 1 or tuple(_tail(tokens, n)) == self._trigger

    def _consume(self, token: int) -> None:
        if self._matcher.is_stopped():
            # mlx-lm runs one more step before it retires a sequence that sampled an
            # end-of-sequence token; any other token here means the mask was ignored.
            if token not in self._eos_set:
                self.error = f"token {token} sampled after the grammar completed"
        elif not self._matcher.consume_token(token):
            self.error = self._matcher.get_error() or f"token {token} rejected by grammar"
        else:
            self.consumed += 1

    def _next_allowed(self, vocab: int) -> np.ndarray:
        """A boolean array over the model's vocabulary: may this token come next?"""
        if self.error is None:
            bits = self._fill_bitmask()
            if self._matcher.is_error():
                self.error = self._matcher.get_error()
            else:
                allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")
                return _fit(allowed, vocab)
        allowed = np.zeros(vocab, dtype=np.uint8)
        allowed[self._eos_ids[self._eos_ids < vocab]] = 1
        return allowed

    def _fill_bitmask(self) -> np.ndarray:
        if self._bitmask is None:
            self._bitmask = np.zeros(self._mask_words, dtype=np.int32)
        # Rust writes the mask straight into our buffer and releases the GIL meanwhile.
        self._matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        return self._bitmask


def _tail(tokens: mx.array, n: int) -> list[int]:
    """The last ``n`` token ids (waits for the step that sampled the last one)."""
    return cast(list[int], tokens[-n:].tolist())


def _fit(allowed: np.ndarray, vocab: int) -> np.ndarray:
    """Trim or zero-pad a mask to the model's vocabulary (their sizes often differ)."""
    if allowed.shape[0] >= vocab:
        return allowed[:vocab]
    return np.concatenate([allowed, np.zeros(vocab - allowed.shape[0], dtype=allowed.dtype)])


def _apply_mask(logits: mx.array, allowed: np.ndarray) -> mx.array:
    # 0/1 bytes reinterpret as booleans without a copy.
    return mx.where(mx.array(allowed.view(np.bool_)), logits, -float("inf"))
