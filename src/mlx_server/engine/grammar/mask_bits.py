"""Packed token masks (llguidance's layout: bit ``t % 32`` of 32-bit word ``t // 32`` says
whether token ``t`` is allowed) and applying them to a batch of logits in one operation.

A model's logits are often wider or narrower than its tokenizer's vocabulary (the mask's
width): ids past the mask are never allowed for a constrained row, and rows without a
constraint are all ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

_SHIFTS: dict[mx.Dtype, mx.array] = {}


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
    """``logits`` (rows × vocab) with every token a row's packed mask forbids set to -inf."""
    return mx.where(unpack(words, logits.shape[-1]), logits, -float("inf"))
