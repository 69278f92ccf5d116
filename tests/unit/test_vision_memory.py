"""The vision tower's memory at admission: the estimate from the pixel values' shapes and the
tower's config (runners/vision_memory.py), and the scheduler counting it — refused when the
KV and the tower cannot fit the budget at all, waiting while they cannot fit beside the
running requests."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest

from mlx_server.engine.core.handle import GenerationHandle
from mlx_server.engine.core.scheduler import MEDIA_REFUSAL_DIVISOR, Scheduler
from mlx_server.engine.runners.vision_memory import media_bytes, tower_bytes
from mlx_server.errors import RequestTooLarge
from mlx_server.types import GenerationRequest

SIGLIP = SimpleNamespace(
    hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
    patch_size=14, num_channels=3,
)  # fmt: skip
QWEN = SimpleNamespace(
    embed_dim=64, hidden_size=999, depth=2, mlp_ratio=2, num_heads=4, patch_size=14,
    temporal_patch_size=2, in_channels=3,
)  # fmt: skip


def vlm(tower: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(vision_config=tower))


def expected(patches: int, per_image: int, pixels: int) -> int:
    per_patch = 64 * (2 + 16) + 2 * 128 + 2 * 4 * per_image
    return patches * per_patch * 4 + pixels * 4


def test_the_estimate_counts_patches_of_each_layout():
    image = mx.zeros((1, 3, 56, 56))  # 16 patches
    assert tower_bytes(vlm(SIGLIP), {"pixel_values": image}) == expected(16, 16, image.size)
    tiles = mx.zeros((1, 2, 3, 56, 56))  # Idefics3: two tiles of 16 patches
    assert tower_bytes(vlm(SIGLIP), {"pixel_values": tiles}) == expected(32, 16, tiles.size)
    both = [image, image]  # a list of images (Pixtral)
    assert tower_bytes(vlm(SIGLIP), {"pixel_values": both}) == expected(32, 16, 2 * image.size)
    flat = mx.zeros((32, 3 * 2 * 14 * 14))  # Qwen-VL: two images' flat patches
    grids = {"image_grid_thw": mx.array([[1, 4, 4], [1, 4, 4]])}
    got = tower_bytes(vlm(QWEN), {"pixel_values": flat, **grids})
    assert got == expected(32, 16, flat.size)  # embed_dim, not the output hidden_size
    video = {"pixel_values_videos": flat, "video_grid_thw": mx.array([[2, 4, 4]])}
    assert tower_bytes(vlm(QWEN), video) == expected(32, 32, flat.size)  # frames attend together


def test_no_pixels_no_tower():
    assert tower_bytes(vlm(SIGLIP), None) == 0
    assert tower_bytes(vlm(SIGLIP), {"attention_mask": mx.ones((1, 4))}) == 0


def request(i: int, side: int) -> GenerationRequest:
    inputs = {"pixel_values": mx.zeros((1, 3, side, side))}
    return GenerationRequest(f"r{i}", [1] * 10, 10, vision_inputs=inputs)


@pytest.fixture(autouse=True)
def buffer_cache_limit():
    """The scheduler's budget lowers MLX's buffer-cache limit (process-wide): put it back."""
    limit = mx.set_cache_limit(0)
    mx.set_cache_limit(limit)
    yield
    mx.set_cache_limit(limit)


@pytest.fixture
def handle():
    """Handles for queued requests (nothing is delivered to them)."""
    loop = asyncio.new_event_loop()
    yield lambda request_id: GenerationHandle(request_id, loop)
    loop.close()


def scheduler(budget: int, prefixes: Any = None) -> Scheduler:
    return Scheduler(
        max_batch_size=8,
        max_queue=8,
        prefill_step_size=512,
        kv_budget_bytes=budget,
        kv_bytes_per_token=16,
        prefix_cache=prefixes,
        media_bytes=media_bytes(vlm(SIGLIP)),
    )


def test_a_request_whose_tower_cannot_fit_the_budget_is_refused(handle):
    small = tower_bytes(vlm(SIGLIP), request(0, 56).vision_inputs)
    sched = scheduler(small + 20 * 16)  # the KV (20 tokens) and one small image's tower
    sched.queue(request(0, 56), handle("r0"))
    with pytest.raises(RequestTooLarge, match="vision tower") as err:
        sched.queue(request(1, 112), handle("r1"))
    assert err.value.status == 413 and len(sched.pending) == 1


def test_a_request_waits_while_its_tower_cannot_fit_beside_the_running_ones(handle):
    small = tower_bytes(vlm(SIGLIP), request(0, 56).vision_inputs)
    sched = scheduler(small + 2 * 20 * 16 - 1)  # two requests' KV, one of them with its tower
    for i in range(2):
        sched.queue(request(i, 56), handle(f"r{i}"))
    first = sched.next_admissible(lambda s: None)
    assert first is not None and first.media_bytes == small
    first.uid = sched.next_uid()
    sched.run(first)
    assert sched.next_admissible(lambda s: None) is None  # its tower would not fit
    sched.active.pop(first.uid)
    sched.release(first)
    assert sched.next_admissible(lambda s: None) is not None


def test_an_image_whose_estimate_is_over_the_budget_but_a_share_fits_runs_alone(handle):
    """The estimate is an upper bound: an image is refused only when a share of it cannot
    fit (MEDIA_REFUSAL_DIVISOR); otherwise it runs, alone when nothing else does."""
    large = tower_bytes(vlm(SIGLIP), request(0, 112).vision_inputs)
    sched = scheduler(20 * 16 + large // 2)  # the KV and half the estimate
    assert MEDIA_REFUSAL_DIVISOR >= 2
    sched.queue(request(0, 112), handle("r0"))
    seq = sched.next_admissible(lambda s: None)
    assert seq is not None and seq.media_bytes == large


class Prefixes:
    """A prefix cache holding the first ``held`` tokens of any prompt, ``nbytes`` big; an
    eviction drops it all."""

    def __init__(self, held: int, nbytes: int = 0):
        self.held, self.nbytes, self.disk, self.on_insert = held, nbytes, None, None

    def __len__(self) -> int:
        return 1

    def prepare(self, key: list[int]) -> bool:
        return True

    def cached_length(self, tokens: list[int]) -> int:
        return min(self.held, len(tokens) - 1)

    def evict_bytes(self, n: int, keep_newest: bool = False) -> int:
        freed, self.held, self.nbytes = self.nbytes, 0, 0
        return freed


def turn(i: int, side: int) -> GenerationRequest:
    """A later turn of a chat: an image's 4 placeholders at positions 2-5 (keyed by the
    image's content in the cache tokens), then text."""
    return replace(
        request(i, side),
        prompt_tokens=[1, 1, 9, 9, 9, 9, 1, 1, 1, 1],
        cache_tokens=[1, 1, -7, -7, -7, -7, 1, 1, 1, 1],
    )


def _running(sched: Scheduler, handle) -> None:
    """A text request (20 tokens of KV: 320 bytes) admitted and running."""
    sched.queue(GenerationRequest("running", [1] * 10, 10), handle("running"))
    seq = sched.next_admissible(lambda s: None)
    assert seq is not None
    seq.uid = sched.next_uid()
    sched.run(seq)


@pytest.mark.parametrize("held, waits", [(6, False), (8, False), (5, True), (0, True)])
def test_media_the_prefix_cache_holds_take_no_tower_memory(handle, held, waits):
    """A turn whose image lies inside the cached prefix runs no tower (the text path takes
    it), so it is admitted beside a running request where counting its tower would make it
    wait; one image token past the cached prefix counts the whole tower again."""
    small = tower_bytes(vlm(SIGLIP), request(0, 56).vision_inputs)
    sched = scheduler(small + 2 * 320 - 1, Prefixes(held))  # both KVs, not the tower
    _running(sched, handle)
    sched.queue(turn(1, 56), handle("r1"))
    seq = sched.next_admissible(lambda s: None)
    assert (seq is None) == waits
    if seq is not None:
        assert seq.req.request_id == "r1" and sched.media_needed(seq) == 0


def test_making_room_that_evicts_the_prefix_counts_the_tower_again(handle):
    """Room for the turn is made by evicting prefix-cache entries, among them the one that
    held its image: the tower runs after all, so it is counted, and the turn waits."""
    small = tower_bytes(vlm(SIGLIP), request(0, 56).vision_inputs)
    prefixes = Prefixes(8, nbytes=small)  # the turn's KV fits only once it is evicted
    sched = scheduler(small + 2 * 320 - 1, prefixes)
    _running(sched, handle)
    sched.queue(turn(1, 56), handle("r1"))
    assert sched.next_admissible(lambda s: None) is None
    assert prefixes.held == 0  # evicted while making room


def test_an_embedder_without_layers_counts_a_projection_not_a_tower():
    """Gemma 4 unified's vision "tower" projects each row of pixel values (a 48-pixel model
    patch) to one embedding (mlx-vlm's ``vision_embedder``; no depth in its config): the
    estimate counts a projection per row. A model with a tower module and the same config
    is still counted as a tower of the default depth (high rather than low)."""
    from mlx_vlm.models.gemma4_unified.config import VisionConfig

    tower = VisionConfig()  # the 12B's: 280 soft tokens of 48 x 48 x 3 pixels
    pixels = mx.zeros((1, 280, 3 * 48 * 48))
    embedder = SimpleNamespace(config=SimpleNamespace(vision_config=tower), vision_embedder=1)
    got = tower_bytes(embedder, {"pixel_values": pixels})
    hidden = tower.hidden_size
    assert got == 280 * (hidden * 16 + 2 * hidden) * 4 + pixels.size * 4
    assert got < 100 * 2**20  # it was 2.8 GiB
    with_tower = SimpleNamespace(config=embedder.config, vision_tower=1)
    assert tower_bytes(with_tower, {"pixel_values": pixels}) > 10 * got
