"""The text runner start-up hands the engine: the lone-request runner in front of the
continuous batch (``solo.LoneFirstRunner``), or the batch alone when ``solo`` is off."""

from __future__ import annotations

from typing import Any

from mlx_server.engine.core.config import EngineConfig
from mlx_server.engine.runners.base import Runner
from mlx_server.engine.runners.batch import BatchRunner
from mlx_server.engine.runners.solo import LoneFirstRunner, SoloRunner


def eos_ids(tokenizer: Any) -> list[int]:
    """The tokenizer's end-of-sequence ids, sorted (what every runner stops on)."""
    return sorted(int(t) for t in tokenizer.eos_token_ids)


def batch_settings(cfg: EngineConfig) -> dict[str, Any]:
    """What every batch runner takes of ``cfg``; finished sequences hand back their KV
    state when the engine has a prefix cache to take it (``prompt_cache_size`` > 0)."""
    return {
        "max_batch_size": cfg.max_batch_size,
        "prefill_step_size": cfg.prefill_step_size,
        "keep_caches": cfg.prompt_cache_size > 0,
    }


def lone_settings(cfg: EngineConfig) -> dict[str, Any]:
    """What every lone-request runner takes of ``cfg``."""
    return {"prefill_step_size": cfg.prefill_step_size, "prefill_buckets": cfg.prefill_buckets}


def text_runner(model: Any, tokenizer: Any, cfg: EngineConfig) -> Runner:
    """The runner for ``model`` under ``cfg``."""
    eos = eos_ids(tokenizer)
    batch = BatchRunner(model, eos, **batch_settings(cfg))
    if not cfg.solo:
        return batch
    return LoneFirstRunner(SoloRunner(model, eos, **lone_settings(cfg)), batch)
