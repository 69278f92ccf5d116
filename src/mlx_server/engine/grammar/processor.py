"""A per-sequence logits processor that enforces an llguidance grammar.

It has mlx-lm's processor signature, ``processor(tokens, logits) -> logits``, so it plugs
into ``BatchGenerator.insert(logits_processors=[[processor], ...])`` and ``generate_step``.
``tokens`` is the sequence's context: its last element is the token sampled at the previous
step (on the first call, the last prompt token, which the grammar must not consume).

The same state machine also runs a step at a time without the context (``observe``,
``consume``, ``record``, ``settle``): ``grammar_masks.GrammarMasks`` drives the grammars of a
whole batch that way, computing every mask in one call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import llguidance
import mlx.core as mx
import numpy as np

from mlx_server.engine.grammar.mask_bits import apply_bitmask, eos_words, fit_words


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
        self.matcher = matcher
        self.mask_words = (mask_vocab + 31) // 32  # llguidance's mask: one bit per token
        self._eos_set = frozenset(eos_ids)
        self.eos_ids = tuple(sorted(self._eos_set))
        self._trigger = tuple(activate_after or ())
        self._recent: list[int] = []  # the context's last len(trigger) tokens while inactive
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
        return self._active and self.matcher.is_accepting()

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        # The context's newest tokens are read from a slice scheduled before the forward
        # pass: a read of anything queued after the pass would wait for all of it. So the
        # mask is computed on the CPU while the device runs this step.
        tail = tokens[-(1 if self._active else len(self._trigger)) :]
        mx.async_eval(tail)
        mx.async_eval(logits)
        last = cast(list[int], tail.tolist())
        if not self._active:
            self._recent = last
            if tuple(last) != self._trigger:
                return logits
            self._active = True
        if self._skip_next:
            self._skip_next = False
        elif self.error is None:
            self.consume(last[-1])
        return apply_bitmask(logits, self._next_words(logits.shape[-1])[None])

    # ---- one step at a time, without the context (the batch's path) ---------------------

    def observe(self, token: int) -> int | None:
        """The context grew by ``token``: whether the grammar applies to the next logits
        (None: not yet active, pass them through) and, if so, the token the matcher must
        consume first (``consume``), or -1 when there is none (just activated)."""
        if not self._active:
            self._recent = (self._recent + [token])[-len(self._trigger) :]
            if tuple(self._recent) != self._trigger:
                return None
            self._active = True
        if self._skip_next:
            self._skip_next = False
            return -1
        return token if self.error is None else -1

    def consume(self, token: int) -> None:
        """Advance the matcher by a sampled token (or record why it cannot)."""
        if self.matcher.is_stopped():
            # mlx-lm runs one more step before it retires a sequence that sampled an
            # end-of-sequence token; any other token here means the mask was ignored.
            if token not in self._eos_set:
                self.error = f"token {token} sampled after the grammar completed"
        else:
            self.record(token, self.matcher.consume_token(token))

    def record(self, token: int, ok: bool) -> None:
        """The outcome of the matcher consuming ``token`` (possibly in a batch call)."""
        if ok:
            self.consumed += 1
        else:
            self.error = self.matcher.get_error() or f"token {token} rejected by grammar"

    def settle(self) -> bool:
        """After the matcher filled its mask: False (and ``error`` set) if that broke it,
        when only end-of-sequence tokens may follow."""
        if self.matcher.is_error():
            self.error = self.matcher.get_error()
            return False
        return True

    # ---- the per-sequence path ----------------------------------------------------------

    def _next_words(self, vocab: int) -> np.ndarray:
        """The packed mask over the model's ``vocab``: may this token come next?"""
        if self.error is None:
            bits = self._fill_bitmask()
            if self.settle():
                return fit_words(bits[None], vocab, fill=0)[0]
        return eos_words(self.eos_ids, vocab)

    def _fill_bitmask(self) -> np.ndarray:
        if self._bitmask is None:
            self._bitmask = np.zeros(self.mask_words, dtype=np.int32)
        # Rust writes the mask straight into our buffer and releases the GIL meanwhile.
        self.matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        return self._bitmask
