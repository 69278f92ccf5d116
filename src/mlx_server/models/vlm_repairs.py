"""Repairs to mlx-vlm's model code, applied when a vision-language model loads (every device).

Qwen2.5-VL's vision tower (``mlx_vlm.models.qwen2_5_vl.vision``, also reused by other families)
splits its window-attention layers at ``cu_window_seqlens``. When an image's merged patch grid is a
multiple of the attention window (448x448 pixels, say), the window padding adds whole windows
of padding, whose boundaries repeat. mlx-vlm's ``__call__`` means to drop the repeats but compares
array scalars (hashed by identity), so none is dropped and attention runs on empty segments.
On Metal and the CPU an empty segment yields an empty output; on CUDA, MLX's
``scaled_dot_product_attention`` with zero queries raises SIGFPE and takes the whole process down
(mlx_vlm.server included). The repair drops the repeats where the boundaries are made, which
changes no output."""

from __future__ import annotations

import sys
from typing import Any

QWEN25_VISION = "mlx_vlm.models.qwen2_5_vl.vision"
_MARK = "_mlx_server_unique_windows"


def repair_loaded() -> list[str]:
    """Repair the mlx-vlm modules imported so far (a model's load imports its own); returns
    the names of the repairs made now (a repeat call makes none)."""
    made = []
    module = sys.modules.get(QWEN25_VISION)
    if module is not None and _unique_window_boundaries(module.VisionModel):
        made.append("qwen2_5_vl window boundaries")
    return made


def qwen25_repaired() -> bool:
    """Whether Qwen2.5-VL's tower has the repair (False while its module is not imported)."""
    module = sys.modules.get(QWEN25_VISION)
    return module is not None and getattr(module.VisionModel.get_window_index, _MARK, False)


def _unique_window_boundaries(cls: Any) -> bool:
    original = cls.get_window_index
    if getattr(original, _MARK, False):
        return False

    def get_window_index(self: Any, grid_thw: Any) -> Any:
        import mlx.core as mx

        window_index, bounds = original(self, grid_thw)
        kept: list[int] = []
        for b in bounds.tolist():
            if not kept or b != kept[-1]:  # the boundaries never decrease
                kept.append(int(b))
        return window_index, mx.array(kept, dtype=bounds.dtype)

    setattr(get_window_index, _MARK, True)
    get_window_index.__wrapped__ = original  # type: ignore[attr-defined]
    cls.get_window_index = get_window_index
    return True
