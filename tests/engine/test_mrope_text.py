"""Qwen-VL's rotary embedding for text positions as plain RoPE (models/mrope_text.py): at
each row's offset it rotates as mlx-vlm's M-RoPE does for the same position on all three
axes, for Qwen2-VL / 2.5-VL's and Qwen3-VL's styles; grid positions (an image's) and calls
outside ``at`` go to mlx-vlm's module; the runner's language model installs it once."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from tiny_vlm import build_tiny_vlm

from mlx_server.engine.cache.mrope import DeltaBatchKVCache, DeltaKVCache, positions, starts
from mlx_server.models import mrope_text
from mlx_server.models.mrope_text import TextRope


def _rotary(family: str):
    if family == "qwen3_vl":
        from mlx_vlm.models.qwen3_vl.language import Qwen3VLRotaryEmbedding as Rotary
    else:
        from mlx_vlm.models.qwen2_5_vl.language import Qwen2RotaryEmbedding as Rotary
    scaling = {"type": "mrope", "mrope_section": [8, 12, 12]}
    return Rotary(64, max_position_embeddings=4096, base=1_000_000.0, rope_scaling=scaling)


def _qk(batch: int, length: int):
    ks = mx.random.split(mx.random.key(1), 2)
    q = mx.random.normal((batch, 4, length, 64), key=ks[0])
    k = mx.random.normal((batch, 2, length, 64), key=ks[1])
    return q, k


def _close(a: mx.array, b: mx.array) -> None:
    np.testing.assert_allclose(np.array(a), np.array(b), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("length", [1, 5])
def test_text_positions_rotate_as_m_rope_does(family, length):
    inner = _rotary(family)
    assert mrope_text.fits(inner)
    rope = TextRope(inner)
    q, k = _qk(3, length)
    starts_ = mx.array([0, 17, 2049])  # each row's offset + delta
    pos = starts_[:, None] + mx.arange(length)[None, :]
    pos = mx.broadcast_to(pos[None], (3, *pos.shape))  # the same on all three axes
    want = inner.apply_rotary(q, k, pos, unsqueeze_dim=1)
    with mrope_text.at([rope], starts_):
        got = rope.apply_rotary(q, k, pos, unsqueeze_dim=1)
    for a, b in zip(got, want, strict=True):
        _close(a, b)
    with mrope_text.at([rope], 17):  # a lone sequence's offset, a number
        one = rope.apply_rotary(q[1:2], k[1:2], pos[:, 1:2], unsqueeze_dim=1)
    _close(one[0], want[0][1:2])
    assert rope.offsets is None  # only inside ``at``


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_grid_positions_keep_mlx_vlm_s_rotation(family):
    inner = _rotary(family)
    rope = TextRope(inner)
    q, k = _qk(1, 6)
    grid = mx.array([[[3, 3, 3, 3, 4, 5]], [[3, 3, 4, 4, 5, 6]], [[3, 4, 3, 4, 7, 8]]])
    want = inner.apply_rotary(q, k, grid, unsqueeze_dim=1)
    got = rope.apply_rotary(q, k, grid, unsqueeze_dim=1)  # outside ``at``
    for a, b in zip(got, want, strict=True):
        _close(a, b)
    # and the grid's rotation is not plain RoPE's: the test above could tell them apart
    with mrope_text.at([rope], 3):
        plain = rope.apply_rotary(q, k, grid, unsqueeze_dim=1)
    assert not np.allclose(np.array(plain[0]), np.array(want[0]), atol=1e-3)


def test_rows_start_at_their_cache_offset_plus_delta():
    a, b = DeltaKVCache(delta=-40), DeltaKVCache(delta=0)
    a.update_and_fetch(mx.zeros((1, 2, 60, 8)), mx.zeros((1, 2, 60, 8)))
    b.update_and_fetch(mx.zeros((1, 2, 9, 8)), mx.zeros((1, 2, 9, 8)))
    assert starts([a]) == 20
    batch = DeltaBatchKVCache.merge([a, b])
    assert starts([batch]).tolist() == [20, 9]
    assert positions([batch], 2)[:, :, :].tolist() == [[[20, 21], [9, 10]]] * 3


def test_the_runner_installs_it_once_and_the_model_gives_what_it_gave(tmp_path: Path):
    from mlx_server.engine.runners.vision_prefill import LanguageModel
    from mlx_server.models.loader import load_model

    vlm = load_model(str(build_tiny_vlm(tmp_path / "vlm"))).model
    lm = vlm.language_model
    ids = mx.array([[5, 9, 11, 3, 7, 2]])
    cache = [DeltaKVCache(delta=0) for _ in lm.layers]
    before = lm(ids, cache=cache).logits  # mlx-vlm's own path, nothing installed
    step_cache = [DeltaKVCache(delta=0) for _ in lm.layers]
    wrapped = LanguageModel(vlm)
    assert len(wrapped.text_ropes) == len(lm.layers)
    assert all(isinstance(layer.self_attn.rotary_emb, TextRope) for layer in lm.layers)
    assert LanguageModel(vlm).text_ropes == wrapped.text_ropes  # a second wrapper: the same
    prefill = wrapped(ids[:, :4], cache=step_cache)
    step = wrapped(ids[:, 4:], cache=step_cache)  # after the prefill, at offset 4
    _close(mx.concatenate([prefill, step], axis=1), before)
