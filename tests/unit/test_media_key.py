"""The prefix cache's key for prompts with media (models/media_key.py), and Qwen-VL's cache
kind that carries a sequence's position delta through the batch and the disk tier
(engine/cache/mrope.py)."""

from __future__ import annotations

import mlx.core as mx
from PIL import Image

from mlx_server.engine.cache.mrope import DeltaBatchKVCache, DeltaKVCache, positions
from mlx_server.engine.cache.serialize import deserialize, serialize
from mlx_server.models.media_key import cache_key, media_digest

IMG = 9  # the placeholder id in these prompts


def digest(color) -> bytes:
    return media_digest(Image.new("RGB", (8, 8), color))


RED, BLUE = digest((255, 0, 0)), digest((0, 0, 255))


def test_placeholders_carry_the_image_and_nothing_else_changes():
    tokens = [1, 2, IMG, IMG, IMG, 3, 4]
    red = cache_key(tokens, [RED], {IMG})
    assert red is not None and len(red) == len(tokens)
    assert [t for i, t in enumerate(red) if i not in (2, 3, 4)] == [1, 2, 3, 4]
    assert all(-(2**31) <= t < 0 for t in red[2:5])  # negative, and 32-bit for the disk tier
    assert cache_key(tokens, [digest((255, 0, 0))], {IMG}) == red  # the same pixels
    blue = cache_key(tokens, [BLUE], {IMG})
    assert blue is not None and blue[:2] == red[:2] and blue[2] != red[2]


def test_a_later_image_keeps_the_first_images_prefix():
    one = cache_key([1, IMG, IMG, 2], [RED], {IMG})
    two = cache_key([1, IMG, IMG, 2, IMG, IMG, 3], [RED, BLUE], {IMG})
    swapped = cache_key([1, IMG, IMG, 2, IMG, IMG, 3], [BLUE, RED], {IMG})
    assert one is not None and two is not None and swapped is not None
    assert two[:4] == one  # turn 1's prompt is a prefix of turn 2's key
    assert swapped[1] != two[1]
    # Runs that outnumber the images (tiles) carry every image up to theirs, so a second
    # image never keys like the first one.
    tiles = cache_key([IMG, 5, IMG, 5, IMG], [RED, BLUE], {IMG})
    assert tiles is not None and tiles[0] != tiles[2] and tiles[2] == tiles[4]


def test_without_placeholders_every_token_carries_the_media():
    tokens = [1, 2, 3, 4]
    red = cache_key(tokens, [RED], {IMG})
    assert red is not None and all(t < 0 for t in red)
    assert red == cache_key(tokens, [RED], set()) != cache_key(tokens, [BLUE], {IMG})
    assert cache_key([5, 2, 3, 4], [RED], {IMG}) != red
    assert cache_key(tokens, [], {IMG}) is None  # no media: the tokens are the key


def _filled(n: int, delta: int) -> DeltaKVCache:
    c = DeltaKVCache(delta)
    c.update_and_fetch(mx.ones((1, 2, n, 4)), mx.ones((1, 2, n, 4)))
    return c


def test_the_delta_survives_the_batch_and_the_disk_tier():
    a, b = _filled(3, -5), _filled(5, 0)
    batch = DeltaKVCache.merge([a, b])
    assert isinstance(batch, DeltaBatchKVCache) and batch.deltas.tolist() == [-5, 0]
    # Each row's next position: its tokens so far plus its delta, on all three axes.
    pos = positions([batch], 2)
    assert pos.shape == (3, 2, 2) and pos[0].tolist() == [[-2, -1], [5, 6]]
    batch.extend(DeltaKVCache.merge([_filled(2, 7)]))
    batch.filter([0, 2])
    assert batch.deltas.tolist() == [-5, 7]
    back = batch.extract(0)
    assert isinstance(back, DeltaKVCache) and back.delta == -5 and back.offset == 3
    arrays, meta, trimmable = serialize([back], 3)
    (loaded,) = deserialize(arrays, meta)
    assert isinstance(loaded, DeltaKVCache) and loaded.delta == -5 and loaded.offset == 3
    assert positions([loaded], 1).tolist() == [[[-2]]] * 3
