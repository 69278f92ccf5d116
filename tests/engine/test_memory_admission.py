"""Admission against all memory: running sequences' KV, the prefix cache's RAM tier and
MLX's buffer cache share one budget; the prefix cache gives memory back (to disk) before
requests wait, and nothing is killed."""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest
from engine_runner import drive, generate_all, request, running_engine
from support import build_wide_model

from mlx_server.engine.cache.disk import DiskPromptCache
from mlx_server.engine.cache.prefix import PrefixCache
from mlx_server.engine.core.memory import MemoryBudget
from mlx_server.models.loader import kv_bytes_per_token

MB = 1 << 20


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    from mlx_lm import load

    path = build_wide_model(tmp_path_factory.mktemp("wide") / "tiny-wide")
    model, tokenizer, config = load(str(path), return_config=True)  # type: ignore[misc]
    return model, tokenizer, config


class Sampler:
    """Highest MLX memory (in use plus buffer cache) above a baseline, sampled in the
    background while a block runs."""

    def __init__(self) -> None:
        mx.clear_cache()
        self.base = mx.get_active_memory()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            used = mx.get_active_memory() + mx.get_cache_memory() - self.base
            self.peak = max(self.peak, used)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_many_long_prompts_under_a_small_budget_all_finish_within_it(wide, tmp_path):
    model, tokenizer, config = wide
    per_token = kv_bytes_per_token(config, 4)
    prompts = [
        list(tokenizer.encode(f"prompt {i} " + "the quick brown fox jumps " * 60))
        for i in range(10)
    ]
    one = (len(prompts[0]) + 16) * per_token  # one request's KV (~8 MB)
    budget = 3 * one
    disk = DiskPromptCache(tmp_path, 1 << 30, min_tokens=64)
    with (
        Sampler() as mem,
        running_engine(
            model,
            tokenizer,
            kv_bytes_per_token=per_token,
            kv_budget_bytes=budget,
            prompt_cache_disk=disk,
        ) as engine,
    ):
        results = drive(engine, generate_all(engine, [request(p, 16) for p in prompts]))
        stats = engine.stats()
    assert [r.reason for r in results] == ["length"] * len(prompts)  # nothing killed
    # Without the shared budget the RAM tier would keep all 16 states (~80 MB).
    assert stats["prompt_cache_bytes"] <= budget
    assert stats["memory_prefix_cache_evicted_bytes"] >= 5 * one
    assert stats["prompt_cache_disk_entries"] >= 5  # what RAM gave back went to disk
    # Stated margin: mlx-lm copies a prefill batch's KV when it joins the decode batch
    # (deepcopy in PromptProcessingBatch.split, then concatenation), so transient memory can
    # reach twice the admitted KV on top of the budget.
    print(f"peak {mem.peak / MB:.0f} MB, budget {budget / MB:.0f} MB")
    assert mem.peak <= 3 * budget, f"peak {mem.peak / MB:.0f} MB, budget {budget / MB:.0f} MB"


def test_the_prefix_cache_gives_memory_back_before_a_request_waits():
    from mlx_lm.models.cache import KVCache

    def state(n: int) -> list[KVCache]:
        c = KVCache()
        c.keys = c.values = mx.zeros((1, 1, n, 256))
        c.offset = n
        mx.eval(c.keys)
        return [c]

    pc = PrefixCache(16, 1 << 30)
    for i in range(4):
        pc.insert([i] * 1024 + [i + 100], state(1025))
    entry = pc.nbytes // 4
    mx.clear_cache()
    budget = MemoryBudget(5 * entry, pc)
    assert budget.fits(entry)  # fits beside the four entries
    assert budget.fits(3 * entry) and len(pc) == 2  # two entries given back, not more
    assert not budget.fits(6 * entry) and len(pc) == 2  # can never fit: nothing evicted
    assert budget.evicted_bytes == 2 * entry


def test_the_writes_waiting_for_the_disk_hold_a_sixteenth_of_the_budget_at_most(tmp_path):
    """Beyond its slots the disk tier takes states while the waiting writes hold at most
    ``max_pending_bytes`` (memory of the budget until written): the budget lowers it to a
    sixteenth of itself, and leaves it where the budget is large."""
    from mlx_server.engine.cache.disk import MAX_PENDING_BYTES

    small = DiskPromptCache(tmp_path / "small", 1 << 30)
    large = DiskPromptCache(tmp_path / "large", 1 << 30)
    try:
        MemoryBudget(64 * MB, PrefixCache(16, 1 << 30, disk=small))
        MemoryBudget(64 << 30, PrefixCache(16, 1 << 30, disk=large))
        assert small.max_pending_bytes == 4 * MB
        assert large.max_pending_bytes == MAX_PENDING_BYTES
    finally:
        assert small.close(10) and large.close(10)
