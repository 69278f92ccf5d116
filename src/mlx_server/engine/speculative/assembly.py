"""The speculative text runner start-up hands the engine when speculation is on: requests
speculate alone (``runner.SpeculativeRunner``) and batched (``batch_runner``); a sequence
the lone runner hands to the batch keeps its drafter (``adopt``)."""

from __future__ import annotations

from typing import Any

from mlx_server.engine.core.config import EngineConfig
from mlx_server.engine.runners.assembly import eos_ids
from mlx_server.engine.runners.base import Runner
from mlx_server.engine.runners.solo import LoneFirstRunner
from mlx_server.engine.speculative.batch_runner import SpeculativeBatchRunner
from mlx_server.engine.speculative.runner import Speculation, SpeculativeRunner


def speculative_runner(model: Any, tokenizer: Any, cfg: EngineConfig, spec: Speculation) -> Runner:
    """As ``runners.assembly.text_runner``, each part speculating under ``spec``."""
    eos = eos_ids(tokenizer)
    batch = SpeculativeBatchRunner(
        model,
        eos,
        max_batch_size=cfg.max_batch_size,
        prefill_step_size=cfg.prefill_step_size,
        keep_caches=cfg.prompt_cache_size > 0,
        spec=spec,
    )
    if not cfg.solo:
        return batch
    lone = SpeculativeRunner(
        model,
        eos,
        prefill_step_size=cfg.prefill_step_size,
        prefill_buckets=cfg.prefill_buckets,
        spec=spec,
    )
    batch.adopt = lone.take_handed
    return LoneFirstRunner(lone, batch)
