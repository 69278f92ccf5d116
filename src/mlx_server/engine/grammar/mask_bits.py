"""Packed token masks (llguidance's layout: bit ``t % 32`` of 32-bit word ``t // 32`` says
whether token ``t`` is allowed) and applying them to a batch of logits in one operation.

A model's logits are often wider or narrower than its tokenizer's vocabulary (the mask's
width): ids past the mask are never allowed for a constrained row, and rows without a
constraint are all ones.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence

import mlx.core as mx
import numpy as np

_SHIFTS: dict[mx.Dtype, mx.array] = {}
_POSITIONS: dict[int, tuple[mx.array, mx.array]] = {}

FUSED: bool | None = None
"""Whether to mask the logits in one compiled graph (a gather of each token's word and one
fused kernel for the shift, the bit and the ``where``) instead of five separate kernels.
None: on a GPU only (on a CPU numpy unpacks the bits faster than the graph gathers them).
A module switch so that tests and benchmarks can run either way anywhere."""


def fused() -> bool:
    return FUSED if FUSED is not None else mx.default_device() != mx.cpu


def words_for(vocab: int) -> int:
    """Words of a packed mask over ``vocab`` tokens."""
    return (vocab + 31) // 32


def fit_words(bits: np.ndarray, vocab: int, *, fill: int) -> np.ndarray:
    """``bits`` (rows × words) trimmed or padded with ``fill`` words to cover ``vocab``."""
    width = words_for(vocab)
    have = bits.shape[1]
    if have >= width:
        return bits[:, :width]
    pad = np.full((bits.shape[0], width - have), fill, dtype=np.int32)
    return np.concatenate([bits, pad], axis=1)


def eos_words(eos_ids: Sequence[int], vocab: int) -> np.ndarray:
    """The packed mask allowing only ``eos_ids`` (those within ``vocab``)."""
    row = np.zeros(words_for(vocab), dtype=np.uint32)
    for t in eos_ids:
        if 0 <= t < vocab:
            row[t // 32] |= np.uint32(1 << (t % 32))
    return row.view(np.int32)


def unpack(words: np.ndarray, vocab: int) -> mx.array:
    """Booleans (rows × ``vocab``) from packed masks that cover ``vocab``.

    On a CPU numpy unpacks the bits and MLX copies the bytes; on a GPU the packed words
    (a 32nd of the size) go over and the device unpacks them, in a few batched kernels.
    """
    if mx.default_device() == mx.cpu:
        return unpack_on_host(words, vocab)
    return unpack_on_device(words, vocab)


def unpack_on_host(words: np.ndarray, vocab: int) -> mx.array:
    flat = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    return mx.array(np.ascontiguousarray(flat).view(np.bool_))


def unpack_on_device(words: np.ndarray, vocab: int) -> mx.array:
    packed = mx.array(np.ascontiguousarray(words, dtype=np.int32))
    shifts = _SHIFTS.get(packed.dtype)
    if shifts is None:
        shifts = _SHIFTS[packed.dtype] = mx.arange(32, dtype=packed.dtype)
    bits = (packed[:, :, None] >> shifts) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab].astype(mx.bool_)


def apply_bitmask(logits: mx.array, words: np.ndarray) -> mx.array:
    """``logits`` (rows × vocab) with every token a row's packed mask forbids set to -inf.

    ``words`` has one row per row of ``logits`` (all ones, -1, for a row left free)."""
    if fused():
        return masked_on_device(logits, words)
    return mx.where(unpack(words, logits.shape[-1]), logits, -float("inf"))


def masked_on_device(logits: mx.array, words: np.ndarray) -> mx.array:
    """``apply_bitmask`` as one compiled graph: the packed words go over (a 32nd of the
    booleans' size), each token's word is gathered and its bit tested in the ``where``."""
    vocab = logits.shape[-1]
    positions = _POSITIONS.get(vocab)
    if positions is None:
        t = mx.arange(vocab, dtype=mx.int32)
        positions = _POSITIONS[vocab] = (t // 32, t % 32)
        mx.eval(*positions)  # made once, read from any thread's stream
    packed = mx.array(np.ascontiguousarray(words, dtype=np.int32))
    return _masked(logits, packed, *positions)


def warm_mask(vocab: int, dtype: mx.Dtype) -> Generator[None, None, None]:
    """A warm-up piece: the compiled mask's kernels built for a row of ``vocab`` logits in
    ``dtype`` (the model's), so that a first structured request does not wait for them."""
    words = np.full((1, words_for(vocab)), -1, dtype=np.int32)
    mx.eval(apply_bitmask(mx.zeros((1, vocab), dtype=dtype), words))
    yield from ()


@mx.compile
def _masked(logits: mx.array, packed: mx.array, word: mx.array, bit: mx.array) -> mx.array:
    allowed = ((mx.take(packed, word, axis=1) >> bit) & 1).astype(mx.bool_)
    return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))
