"""An engine's parts built from its config: the prefix cache, the scheduler, and the runner
it uses when none is given: the lone-request runner in front of the continuous batch
(``solo.LoneFirstRunner``), each speculative when the config says so."""

from __future__ import annotations

from typing import Any

from mlx_server.engine.cache.prefix import PrefixCache
from mlx_server.engine.core.config import EngineConfig
from mlx_server.engine.core.scheduler import Scheduler
from mlx_server.engine.runners.base import Runner
from mlx_server.engine.runners.batch import BatchRunner
from mlx_server.engine.runners.solo import LoneFirstRunner, SoloRunner


def prefix_cache(cfg: EngineConfig) -> PrefixCache | None:
    """The prefix cache (None when its size is 0)."""
    if cfg.prompt_cache_size <= 0:
        return None
    return PrefixCache(
        cfg.prompt_cache_size,
        cfg.prompt_cache_bytes,
        disk=cfg.prompt_cache_disk,
        disk_off_reason=cfg.prompt_cache_disk_off,
    )


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
    )


def default_runner(model: Any, eos_ids: list[int], cfg: EngineConfig, keep_caches: bool) -> Runner:
    """``keep_caches``: finished sequences hand back their KV state (a prefix cache takes it)."""
    spec = cfg.speculation
    batch: BatchRunner
    if spec is not None:  # the batch speculates too (speculative/batch.py)
        from mlx_server.engine.speculative.batch_runner import SpeculativeBatchRunner

        batch = SpeculativeBatchRunner(
            model,
            eos_ids,
            max_batch_size=cfg.max_batch_size,
            prefill_step_size=cfg.prefill_step_size,
            keep_caches=keep_caches,
            spec=spec,
        )
    else:
        batch = BatchRunner(
            model,
            eos_ids,
            max_batch_size=cfg.max_batch_size,
            prefill_step_size=cfg.prefill_step_size,
            keep_caches=keep_caches,
        )
    if not cfg.solo:
        return batch
    if spec is not None:
        from mlx_server.engine.speculative.runner import SpeculativeRunner

        lone: SoloRunner = SpeculativeRunner(
            model,
            eos_ids,
            prefill_step_size=cfg.prefill_step_size,
            prefill_buckets=cfg.prefill_buckets,
            spec=spec,
        )
        batch.adopt = lone.take_handed  # type: ignore[attr-defined]
    else:
        lone = SoloRunner(
            model,
            eos_ids,
            prefill_step_size=cfg.prefill_step_size,
            prefill_buckets=cfg.prefill_buckets,
        )
    return LoneFirstRunner(lone, batch)
