"""Memory settings every start-up applies: MLX's buffer cache and the prefix cache's RAM tier."""

from __future__ import annotations

import mlx.core as mx

from mlx_server.config import Settings
from mlx_server.logs import log
from mlx_server.models.loader import device_memory_bytes


def set_cache_limit(settings: Settings) -> int:
    """MLX's buffer-cache limit (freed buffers kept for reuse). Returns bytes."""
    if settings.cache_limit_gb is not None:
        limit = int(settings.cache_limit_gb * (1 << 30))
    else:
        limit = min(device_memory_bytes() // 4, 20 << 30)
    mx.set_cache_limit(limit)
    log(f"Memory cache limit: {limit // (1 << 20)}MB")
    return limit


def kv_budget_bytes(settings: Settings) -> int:
    """``--kv-budget-gb``, else a quarter of the device's memory."""
    budget = settings.kv_budget_gb
    return int(budget * (1 << 30)) if budget is not None else device_memory_bytes() // 4


def prompt_cache_bytes(settings: Settings, kv_budget: int) -> int:
    """The prefix cache's RAM tier: ``--prompt-cache-gb``, else the whole KV budget. The
    budget (engine/core/memory.py) counts the tier and evicts from it before a request waits, so
    cached prompts use memory only while running requests do not need it."""
    if settings.prompt_cache_gb is not None:
        return int(settings.prompt_cache_gb * (1 << 30))
    return kv_budget
