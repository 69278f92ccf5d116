"""An engine's own parts built from its config: the prefix cache and the scheduler (the
runner is start-up's to build: ``runners.assembly``)."""

from __future__ import annotations

from mlx_server.engine.cache.prefix import PrefixCache
from mlx_server.engine.core.config import EngineConfig
from mlx_server.engine.core.scheduler import Scheduler
from mlx_server.engine.core.tuning import SHORT_CHUNK


def prefix_cache(cfg: EngineConfig) -> PrefixCache | None:
    """The prefix cache (None when its size is 0)."""
    if cfg.prompt_cache_size <= 0:
        return None
    cache = PrefixCache(
        cfg.prompt_cache_size,
        cfg.prompt_cache_bytes,
        disk=cfg.prompt_cache_disk,
        disk_off_reason=cfg.prompt_cache_disk_off,
    )
    if cfg.prefill_buckets:  # kernels built per shape: a short prefix costs a graph
        cache.short_hit = SHORT_CHUNK
    return cache


def scheduler(cfg: EngineConfig, cache: PrefixCache | None) -> Scheduler:
    return Scheduler(
        max_batch_size=cfg.max_batch_size,
        max_queue=cfg.max_queue,
        prefill_step_size=cfg.prefill_step_size,
        kv_budget_bytes=cfg.kv_budget_bytes,
        kv_bytes_per_token=cfg.kv_bytes_per_token,
        kv_bytes_per_sequence=cfg.kv_bytes_per_sequence,
        prefix_cache=cache,
        gather_s=cfg.gather_s,
        media_bytes=cfg.media_bytes,
    )
