"""The speculative text runner start-up hands the engine when speculation is on: requests
speculate alone (``runner.SpeculativeRunner``) and batched (``batch_runner``); a sequence
the lone runner hands to the batch keeps its drafter (``adopt``). Each part adds its verify
passes to the engine's warm-up (``warm_shapes``)."""

from __future__ import annotations

from typing import Any

from mlx_server.engine.core.config import EngineConfig
from mlx_server.engine.core.tuning import ShapePieces
from mlx_server.engine.runners.assembly import batch_settings, eos_ids, lone_settings
from mlx_server.engine.runners.base import Runner
from mlx_server.engine.runners.solo import LoneFirstRunner
from mlx_server.engine.speculative.batch_runner import SpeculativeBatchRunner
from mlx_server.engine.speculative.runner import Speculation, SpeculativeRunner


class SpeculativeLoneFirst(LoneFirstRunner):
    """``LoneFirstRunner`` over the two speculative runners."""

    lone: SpeculativeRunner
    batch: SpeculativeBatchRunner

    def warm_shapes(self, max_batch_size: int) -> ShapePieces:
        """The lone path's passes before serving; the batch's, at every size (a batch of
        one too: what is left once the others finish), in idle time."""
        lone, batch = self.lone.warm_shapes(max_batch_size), self.batch.warm_shapes(max_batch_size)
        later = {1: batch.first, **batch.later}
        return ShapePieces(lone.first, later, lone.budget_s, lone.what)


def speculative_runner(model: Any, tokenizer: Any, cfg: EngineConfig, spec: Speculation) -> Runner:
    """As ``runners.assembly.text_runner``, each part speculating under ``spec``."""
    eos = eos_ids(tokenizer)
    batch = SpeculativeBatchRunner(model, eos, spec=spec, **batch_settings(cfg))
    if not cfg.solo:
        return batch
    lone = SpeculativeRunner(model, eos, spec=spec, **lone_settings(cfg))
    batch.adopt = lone.take_handed
    return SpeculativeLoneFirst(lone, batch)
