"""Qwen-VL's rotary embedding, for text positions, as plain RoPE in one fused operation.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL rotate queries and keys by multimodal positions
(M-RoPE): three position streams (time, height, width), each owning a section of the
frequencies. A text token has the same position on all three, and then M-RoPE is plain
RoPE at that position: the sections choose among equal angles. mlx-vlm computes it the
general way where it has no fused kernel of its own (everywhere but Metal): cos and sin
tables over (3, batch, length) positions, then a rotation in several element-wise
operations in every layer. On an H100 the VLM's text decoding ran at 0.91 x its text
twin's (173.6 against 191.5 tok/s, `bench/results/gpu-2026-12-06-vision-h100.jsonl`).

``TextRope`` takes the place of each layer's ``rotary_emb``. While ``at(offsets)`` holds
(the runner's forward whose positions are text positions, ``cache/mrope.positions``: a
decode step, a verify pass, a text chunk), it rotates with ``mx.fast.rope`` at each row's
offset (``offset + delta``) with the module's own frequencies; otherwise (a chunk holding an
image, with grid positions) it is mlx-vlm's module, unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx

# mlx-vlm's styles that pair dimension i with i + dim / 2 (MLX's non-traditional RoPE)
HALF_SPLIT_STYLES = {"chunked", "interleaved"}


class TextRope:
    """A layer's rotary embedding: plain RoPE at ``offsets`` while they are set, the
    wrapped module otherwise (see the module docstring)."""

    fused_apply = True  # each layer calls apply_rotary itself (no shared cos/sin tables)

    def __init__(self, inner: Any):
        self.inner = inner
        self.dim = int(inner.dim)
        self.freqs = 1.0 / inner.inv_freq.astype(mx.float32)  # MLX's rope takes periods
        mx.eval(self.freqs)
        self.offsets: mx.array | int | None = None

    def apply_rotary(
        self,
        q: mx.array,
        k: mx.array,
        position_ids: mx.array,
        *,
        unsqueeze_dim: int = 1,
        cast_output: bool = True,
    ) -> tuple[mx.array, mx.array]:
        offsets = self.offsets
        if offsets is None or unsqueeze_dim != 1 or q.ndim != 4 or k.ndim != 4:
            kw = {"unsqueeze_dim": unsqueeze_dim, "cast_output": cast_output}
            return self.inner.apply_rotary(q, k, position_ids, **kw)
        return self._rope(q, offsets), self._rope(k, offsets)

    def _rope(self, x: mx.array, offsets: mx.array | int) -> mx.array:
        return mx.fast.rope(
            x,
            self.dim,
            traditional=False,
            base=None,
            scale=1.0,
            offset=offsets,
            freqs=self.freqs,
        )

    def __call__(self, x: mx.array, position_ids: mx.array) -> Any:
        return self.inner(x, position_ids)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet
            raise AttributeError(name)
        return getattr(self.inner, name)


def fits(rotary: Any) -> bool:
    """Whether ``rotary`` is an M-RoPE module whose text positions are plain RoPE here."""
    if isinstance(rotary, TextRope):
        return True
    return (
        getattr(rotary, "style", None) in HALF_SPLIT_STYLES
        and float(getattr(rotary, "attention_scaling", 1.0)) == 1.0
        and isinstance(getattr(rotary, "inv_freq", None), mx.array)
        and callable(getattr(rotary, "apply_rotary", None))
        and 2 * rotary.inv_freq.shape[0] == int(getattr(rotary, "dim", -1))
    )


def install(layers: Any) -> list[TextRope]:
    """Give every layer's attention a ``TextRope`` (once; a second call finds them). Returns
    them, or [] where a layer's rotary embedding is not one ``TextRope`` stands for."""
    attns: list[Any] = [getattr(layer, "self_attn", None) for layer in layers]
    rotaries = [getattr(a, "rotary_emb", None) for a in attns]
    if not attns or not all(fits(r) for r in rotaries):
        return []
    out = []
    for attn, rotary in zip(attns, rotaries, strict=True):
        if not isinstance(rotary, TextRope):
            rotary = TextRope(rotary)
            attn.rotary_emb = rotary
        out.append(rotary)
    return out


@contextmanager
def at(ropes: list[TextRope], offsets: mx.array | int) -> Iterator[None]:
    """Text positions for the forward inside: each row's rotation starts at ``offsets``."""
    for r in ropes:
        r.offsets = offsets
    try:
        yield
    finally:
        for r in ropes:
            r.offsets = None
