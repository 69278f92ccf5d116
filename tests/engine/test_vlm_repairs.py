"""The repair of mlx-vlm's Qwen2.5-VL window boundaries (models/vlm_repairs.py): on a merged
patch grid that is a multiple of the window (where padding windows repeat boundaries), the
repaired boundaries strictly increase, keep every boundary mlx-vlm makes, and the tower's output
is unchanged. On CUDA a repeated boundary is an empty attention segment, which kills the
process (SIGFPE in MLX's scaled_dot_product_attention)."""

from __future__ import annotations

import importlib

import mlx.core as mx
import pytest

from mlx_server.models import vlm_repairs

vision = importlib.import_module(vlm_repairs.QWEN25_VISION)


def _tower() -> object:
    config = vision.VisionConfig.from_dict(
        {
            "model_type": "qwen2_5_vl",
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_patch_size": 14,
            "window_size": 56,  # windows of 2x2 merged patches
            "fullatt_block_indexes": [1],
        }
    )
    mx.random.seed(0)
    tower = vision.VisionModel(config)
    mx.eval(tower.parameters())
    return tower


@pytest.mark.parametrize("side", [8, 6, 10])  # merged 4x4: a multiple of the window (repeats)
def test_window_boundaries_unique_and_output_unchanged(side, monkeypatch):
    cls = vision.VisionModel
    original = getattr(cls.get_window_index, "__wrapped__", cls.get_window_index)
    monkeypatch.setattr(cls, "get_window_index", original)  # restored after the test
    tower = _tower()
    grid = mx.array([[1, side, side]])
    pixels = mx.random.normal((side * side, 3 * 2 * 14 * 14))
    _, before_bounds = tower.get_window_index(grid)
    before = tower(pixels, grid)
    mx.eval(before)

    assert vlm_repairs.repair_loaded() == ["qwen2_5_vl window boundaries"]
    assert vlm_repairs.repair_loaded() == []  # once
    _, bounds = tower.get_window_index(grid)
    kept = bounds.tolist()
    assert all(a < b for a, b in zip(kept, kept[1:], strict=False)), kept
    assert sorted(set(before_bounds.tolist())) == kept
    assert kept[0] == 0 and kept[-1] == side * side
    after = tower(pixels, grid)
    assert after.shape == before.shape
    assert mx.allclose(after, before, atol=1e-5).item()
